"""What Anthropic Messages (`POST /v1/messages`, api/messages_route.py) and
OpenAI Responses (`POST /v1/responses`, api/responses_route.py) share when
the local engine answers them (each route, in its own module, imports this one;
api/app.py mounts them).

A request is parsed by its protocol adapter, checked as that provider checks
it when the server runs `--validate` for it (refused with the provider's own
status and body), converted to the runtime's step request (`step_input`: its
history in the runtime's message shape, protocols/convert.py) and answered as
a step (api/step_input.py); the route writes the step back in its protocol's
response shape, plain or streamed (the step's typed events), in its own module.

Bad input is refused as the chat route refuses it, in the route's own error
shape (api/errors.py: Anthropic's on /v1/messages, OpenAI's on /v1/responses),
never passed on to fail later: the sampling figures (`max_tokens` /
`max_output_tokens`, `temperature`, `top_p`, as the chat route bounds them), no messages, a model other than the served one (404; except where
the server answers as that provider, `--validate` for the route's protocol,
which takes the provider's model names as the chat route does), and what the
conversion to a chat history would drop, read into the step's constraint
instead (constrained/wire.py): a forced tool call, the answer's JSON schema
(Responses' `text.format`, Messages' `output_format`), Messages' stop sequences.
"""

from __future__ import annotations

import json
import secrets
from typing import Optional

from fastapi import Request

from session_runtime.api.errors import ModelNotFound
from session_runtime.api.proxy_routes import answerable
from session_runtime.api.step_input import FINISH, StepInput, sampling_figures
from session_runtime.constrained import wire
from session_runtime.constrained.spec import OutputConstraint
from session_runtime.errors import InvalidRequest
from session_runtime.protocols import ProtocolInputError, get_protocol
from session_runtime.protocols.base import dig
from session_runtime.protocols.canonical import Call, Msg, Reasoning, Reply, Usage
from session_runtime.protocols.convert import to_chat
from session_runtime.step import Step

ROUTES = {"/v1/messages": "anthropic", "/v1/responses": "openai-responses", "/v1beta/models/": "gemini"}
# The field that holds the history, and what a request without any is told.
_HISTORY = {"anthropic": ("messages", "at least one message is required"),
            "openai-responses": ("input", "at least one input item is required"),
            "gemini": ("contents", "contents is not specified")}
# The sampling figures' names in each protocol's request.
_NAMES = {"anthropic": {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"},
          "openai-responses": {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"},
          "gemini": {"max_tokens": "generationConfig.maxOutputTokens", "temperature": "generationConfig.temperature",
                     "top_p": "generationConfig.topP"}}


def new_id(prefix: str, random_bytes: int = 12) -> str:
    """An item id as the providers write them (`msg_...`, `toolu_...`,
    `resp_...`): the prefix and random hex, at least 96 bits, so ids from
    different requests never meet."""
    return prefix + secrets.token_hex(random_bytes)


async def read_body(request: Request) -> object:
    """The request's JSON body. Raises InvalidRequest."""
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError) as exc:
        # RecursionError: nested past Python's limit. JsonBodies (api/content_type.py)
        # refuses such a body before it gets here; this is the backstop.
        raise InvalidRequest(f"the body is not JSON: {exc}") from None


def parse(adapter, raw: object):
    """The body parsed by its protocol's adapter. Raises InvalidRequest naming the field it could not read."""
    try:
        return adapter.parse_request(raw)
    except ProtocolInputError as exc:
        raise InvalidRequest(str(exc), param=exc.path) from None


def step_input(adapter, protocol: str, raw: object, served: Optional[str], parsed=None) -> StepInput:
    """The runtime's step request for a body of `protocol` (its history in the
    runtime's message shape, its sampling figures checked); with `served`,
    the body's model must be that one. Raises InvalidRequest naming the field
    the protocol could not read or the runtime would refuse (in the
    protocol's own name), ModelNotFound for another model. `parsed`: the
    body already parsed (`parse`), where the route reads it too."""
    parsed = parsed if parsed is not None else parse(adapter, raw)
    assert isinstance(raw, dict)  # parse_request refuses any other body
    field, missing = _HISTORY[protocol]
    if not parsed.messages:
        raise InvalidRequest(f"{field}: {missing}", param=field)
    if served is not None:
        _check_model(raw.get("model"), served)
    constraint = _constraint(protocol, raw)
    # The runtime's message shape is chat's: every protocol's history converts to it (protocols/convert.py).
    chat = get_protocol("openai-chat").render_request(to_chat(parsed, protocol, "openai-chat"))
    figures = sampling_figures(chat.get("max_tokens"), chat.get("temperature"), chat.get("top_p"), _NAMES[protocol])
    return StepInput(answerable(chat.get("messages") or []), chat.get("tools"), **figures, constraint=constraint)


def _check_model(model: object, served: str) -> None:
    """As the chat route checks `model` (absent or null: the served one).
    Raises ModelNotFound (404) for another model, InvalidRequest for a non-string."""
    if model is None:
        return
    if not isinstance(model, str):
        raise InvalidRequest("model: expected a string", param="model")
    if model != served:
        raise ModelNotFound(f"the model {model!r} does not exist: this server serves {served!r} "
                            "(GET /v1/models)", param="model")


def _constraint(protocol: str, raw: dict) -> OutputConstraint:
    """What the body constrains in the output, which the conversion to a chat
    history drops. Raises InvalidRequest."""
    if protocol == "anthropic":
        return wire.messages(raw)
    if protocol == "gemini":
        return wire.gemini(raw)
    return wire.responses(raw.get("tool_choice"), dig(raw, "text", "format"), dig(raw, "reasoning", "effort"))


def reply_of(step: Step) -> Reply:
    """A step's answer as a canonical reply (reasoning, text, tool calls, usage; chat's finish vocabulary)."""
    calls = tuple(Call(c["id"], c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in step.tool_calls)
    message = Msg("assistant", step.content or "", (Reasoning(step.reasoning),) if step.reasoning else (), calls)
    acc = step.accounting
    usage = Usage(acc.prompt_tokens, acc.output_tokens, acc.cached_input_tokens, step.reasoning_tokens)
    return Reply(message, usage, FINISH.get(step.finish_reason, "stop"), None)
