"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic
Messages, served by the local engine as steps (api/step_input.py; api/protocol_routes.py
has what the protocol routes share). Stateless: each request runs as a step of
the conversation its history continues (session inference,
session_runtime/stateless.py), named in the `x-session-runtime-conversation`
header; mid-conversation system messages, the session key and
`context_management` are read as api/messages_input.py says.

What this server adds to the chat route's answer, as Anthropic's API does:

- ids of its own: `msg_...` for the message and `toolu_...` for each tool_use
  block (the inferred conversation's own call ids, random and in Anthropic's
  form, so the history the client sends back matches the stored one);
- a `signature` on each thinking block (the server secret's signature of its
  text); a thinking block sent back must carry a signature of this server
  (else 400, as Anthropic refuses a tampered or foreign one), and
  `redacted_thinking` blocks, which this server never makes, are refused;
- streaming (`stream: true`) in Anthropic's event sequence (api/messages_stream.py);
- `tool_choice`: auto as the model decides; none is honoured by leaving the
  tools out of the prompt; any and tool force a call (the step's grammar,
  session_runtime/constrained/); `output_format` (or `output_config.format`)
  a JSON schema for the answer; `stop_sequences` end it, answered with
  `stop_reason: "stop_sequence"` and the `stop_sequence` matched;
- usage: `input_tokens` (uncached), `cache_read_input_tokens`,
  `output_tokens` and `output_tokens_details.thinking_tokens`;
- count_tokens: the prompt tokens the same request renders to (api/token_count.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from session_runtime.api.auth import current_caller
from session_runtime.api.lean_route import LeanRoute
from session_runtime.api.context_edits import apply_edits, original_tokens
from session_runtime.api.messages_input import context_edits, fold_system_messages, session_key
from session_runtime.api.messages_stream import Translator
from session_runtime.api.openai_compat import served_name
from session_runtime.api.protocol_routes import new_id, read_body, reply_of, step_input
from session_runtime.api.proxy_routes import validation_error
from session_runtime.api.settings import Caller
from session_runtime.api.step_input import CONVERSATION_HEADER, Stateless, StepAnswers, StepInput
from session_runtime.api.streaming import cancellable
from session_runtime.api.token_count import prompt_tokens
from session_runtime.errors import InvalidRequest
from session_runtime.protocols import get_protocol
from session_runtime.protocols.canonical import Call, Msg, Reasoning, Reply, reasoning_text
from session_runtime.server_secret import ServerSecret

PATH = "/v1/messages"
PROTOCOL = "anthropic"
_TOOL_CHOICES = ("auto", "any", "tool", "none")


def build(answers: StepAnswers, validate: Optional[str], runtime) -> APIRouter:
    """The two routes, answering through `answers`; `validate`:
    the server answers as that provider (--validate), which takes its model names."""
    router = APIRouter(route_class=LeanRoute)  # the step routes' requests read lean (api/lean_route.py)
    adapter = get_protocol(PROTOCOL)
    as_provider = validate == PROTOCOL

    def model_of(raw: object) -> str:
        """The served name the answer carries. Raises ModelNotFound (the provider's names are taken as provider)."""
        model = raw.get("model") if isinstance(raw, dict) else None
        if model is None or as_provider:
            return runtime.served_names[0]
        return served_name(runtime, model)

    def parsed(raw: object, secret: ServerSecret) -> StepInput:
        """The step request of an Anthropic body (its system messages
        folded). Raises InvalidRequest, ModelNotFound."""
        if isinstance(raw, dict):
            raw = fold_system_messages(raw)
        model_of(raw)
        inp = step_input(adapter, PROTOCOL, _tool_choice(raw), None)
        _check_thinking(raw, secret)  # the body parsed: its messages and blocks have their shapes
        return inp

    @router.post(PATH, name=PROTOCOL)
    async def create(request: Request, caller: Caller = Depends(current_caller)):
        raw = await read_body(request)
        if as_provider and (refused := validation_error(PROTOCOL, raw)) is not None:
            return refused
        secret: ServerSecret = request.app.state.secret
        stream = _stream(raw)
        inp = parsed(raw, secret)
        model = model_of(raw)
        applied = await anyio.to_thread.run_sync(apply_edits, runtime, inp.messages, inp.tools, caller.tenant,
                                                  context_edits(raw))
        inp = dataclasses.replace(inp, stream=stream, stateless=Stateless(
            PROTOCOL, session_key(raw, request.headers), applied.policy, applied.cleared, applied.rules))
        edits = applied.report
        render = Translator(new_id("msg_"), model, secret.sign, context_management=edits).render if stream else None
        result = await cancellable(request, lambda cancel: answers.answer(inp, caller, cancel, render))
        if isinstance(result, StreamingResponse):
            result.headers["cache-control"] = "no-cache"
            return result  # the step's events in Anthropic's, rendered by the Translator
        reply = reply_of(result)
        if result.stop_sequence is not None:  # Anthropic names the stop sequence that ended the answer
            reply = dataclasses.replace(reply, extra={"stop_reason": "stop_sequence",
                                                      "stop_sequence": result.stop_sequence})
        body = adapter.render_response(_answer(reply, secret), model)
        if edits is not None:
            body["context_management"] = edits
        return JSONResponse(body, headers={CONVERSATION_HEADER: result.conversation_id})

    @router.post(PATH + "/count_tokens", name=PROTOCOL + "-count-tokens")
    async def count_tokens(request: Request, caller: Caller = Depends(current_caller)):
        """`{"input_tokens": N}`: the prompt tokens, cached or not, that
        messages.create renders for the same body; with context edits, also
        `context_management.original_input_tokens`, the count before them."""
        raw = await read_body(request)
        if as_provider and (refused := validation_error(PROTOCOL, raw)) is not None:
            return refused
        inp = parsed(raw, request.app.state.secret)
        edits = context_edits(raw)
        applied = await anyio.to_thread.run_sync(apply_edits, runtime, inp.messages, inp.tools, caller.tenant, edits)
        count = applied.input_tokens  # counted already where the edits needed it
        if count is None:
            count = await anyio.to_thread.run_sync(prompt_tokens, runtime, inp.messages, inp.tools, caller.tenant,
                                                   applied.policy, applied.cleared)
        if applied.report is None:
            return {"input_tokens": count}
        original = await anyio.to_thread.run_sync(original_tokens, runtime, inp.messages, inp.tools, caller.tenant)
        return {"input_tokens": count, "context_management": {"original_input_tokens": original}}

    return router


def _stream(raw: object) -> bool:
    """The body's `stream`. Raises InvalidRequest for a non-boolean."""
    value = raw.get("stream") if isinstance(raw, dict) else None
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest("stream: expected a boolean", param="stream")
    return bool(value)


def _tool_choice(raw: object) -> object:
    """The body as the chat route is to answer it: with tool_choice none, its
    tools left out of the prompt (the model is not offered any); any and tool
    are the step's constraint (constrained/wire.py). Raises InvalidRequest for
    a tool_choice it cannot read."""
    if not isinstance(raw, dict) or raw.get("tool_choice") is None:
        return raw
    choice = raw["tool_choice"]
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in _TOOL_CHOICES:
        raise InvalidRequest(f"tool_choice: expected an object with type one of {', '.join(_TOOL_CHOICES)}",
                             param="tool_choice")
    if kind == "none":
        return {k: v for k, v in raw.items() if k not in ("tools", "tool_choice")}
    return raw


def _check_thinking(raw: dict, secret: ServerSecret) -> None:
    """Every thinking block of the history must be this server's, its
    signature made by `secret` over its text; redacted_thinking, which this
    server never makes, is refused. Raises InvalidRequest in Anthropic's words."""
    for i, message in enumerate(raw["messages"]):
        if message.get("role") != "assistant" or not isinstance(message.get("content"), list):
            continue
        for j, block in enumerate(message["content"]):
            where = f"messages.{i}.content.{j}"
            if block.get("type") == "redacted_thinking":
                raise InvalidRequest(f"{where}: `redacted_thinking` blocks are not made by this server, so none can "
                                     "be sent to it", param=where)
            if block.get("type") == "thinking" and not secret.verify(block["thinking"], block.get("signature")):
                raise InvalidRequest(f"{where}: Invalid `signature` in `thinking` block", param=where)


def _answer(reply: Reply, secret: ServerSecret) -> Reply:
    """The chat route's reply as this server hands it out: a new message id,
    the thinking (if any) signed in one block, tool calls under new ids."""
    m = reply.message
    text = reasoning_text(m)
    # An empty reasoning makes no block, as the stream opens none for it.
    reasoning = (Reasoning(text, {"type": "thinking", "thinking": text, "signature": secret.sign(text)}),) \
        if text else None
    # The conversation's own toolu_ ids go out as they are: the client sends them back with the results.
    calls = tuple(Call(c.id if c.id.startswith("toolu_") else new_id("toolu_"), c.name, c.arguments) for c in m.calls)
    return dataclasses.replace(reply, message=Msg("assistant", m.content or "", reasoning, calls), id=new_id("msg_"))
