"""POST /v1/chat/completions, OpenAI-compatible.

`reasoning_content` in messages and responses; `conversation_id` (an extra
body field) maps a stateless client to a conversation's chain: the client's
history is checked against the conversation's, the trailing user message or
tool results run as one step, and a history that differs replaces the
conversation's. Without `conversation_id` the request is a stateless
client's: it runs as a step of the conversation its history continues, or of
a new one (session inference, session_runtime/stateless.py). Every answer
names its conversation in the `x-session-runtime-conversation` header.
`logprobs` and `top_logprobs` are honoured (top_logprobs on the embedded engine);
`tool_choice` (required, a function, allowed_tools required), `response_format`
(json_object, json_schema) and `stop` constrain the output (constrained/wire.py);
`tool_choice: none` with tools keeps them in the prompt and the answer from
calling; parameters this server cannot honour (penalties, `logit_bias`, `n` > 1) are refused with 400 unless they hold their
default; other unknown fields are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from session_runtime.api.auth import current_caller
from session_runtime.api.errors import ModelNotFound, openai_body
from session_runtime.api.lean_route import LeanRoute
from session_runtime.api.proxy_routes import answerable, proxy_completion, request_body, validation_error
from session_runtime.api.settings import Caller
from session_runtime.api.step_input import CONVERSATION_HEADER, FINISH, StepAnswers, StepInput
from session_runtime.api.streaming import cancellable, sse_lines
from session_runtime.constrained import wire
from session_runtime.errors import InvalidRequest
from session_runtime.protocols.base import CHAT_PROTOCOLS
from session_runtime.runtime import Runtime
from session_runtime.step import Step


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore
    messages: list[dict[str, Any]] = Field(min_length=1)
    model: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    conversation_id: Optional[str] = None
    policy: Optional[str] = None
    n: int = Field(default=1, ge=1, le=1)  # one choice: a conversation has one chain
    stop: Optional[Union[str, list[str]]] = None
    stream_options: Optional[dict[str, Any]] = None
    create: bool = False  # with conversation_id: create it when it does not exist
    replace: bool = False  # with conversation_id: the client's history replaces the stored one


def tool_calls(step: Step) -> list[dict]:
    """A step's tool calls in OpenAI's shape (arguments as JSON text)."""
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in step.tool_calls]


def chat_usage(step: Step) -> dict:
    """A step's usage in Chat Completions' names."""
    acc = step.accounting
    return {"prompt_tokens": acc.prompt_tokens, "completion_tokens": acc.output_tokens,
            "total_tokens": acc.prompt_tokens + acc.output_tokens,
            "prompt_tokens_details": {"cached_tokens": acc.cached_input_tokens},
            "completion_tokens_details": {"reasoning_tokens": step.reasoning_tokens}}


def _logprobs(step: Step, decode: Callable[[list[int]], str]) -> Optional[dict]:
    """OpenAI's `logprobs` of a choice: each output token, its text, bytes and
    logprob, and with `top_logprobs` the most likely tokens there. None when not
    asked for."""
    if step.logprobs is None:
        return None

    def entry(tok: int, logprob: float) -> dict:
        text = decode([tok])
        # A token inside a multi-byte character decodes to U+FFFD alone: no bytes of its own to show.
        return {"token": text, "logprob": logprob, "bytes": None if "\ufffd" in text else list(text.encode("utf-8"))}

    tops = step.top_logprobs or [[] for _ in step.output_ids]
    return {"content": [{**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                        for tok, lp, top in zip(step.output_ids, step.logprobs, tops)]}


def _refuse_unsupported(body: "ChatRequest") -> None:
    """OpenAI parameters this server cannot honour, set to anything but their
    default: refused with 400 rather than ignored. Raises InvalidRequest."""
    extra = body.model_extra or {}
    fine = {
        "presence_penalty": lambda v: v in (None, 0),
        "frequency_penalty": lambda v: v in (None, 0),
        "logit_bias": lambda v: not v,
    }
    for name, ok in fine.items():
        if name in extra and not ok(extra[name]):
            raise InvalidRequest(f"{name} {extra[name]!r} is not supported by this server; leave it out",
                                 param=name)


def completion(step: Step, model: str, rid: str, decode: Callable[[list[int]], str]) -> dict:
    message = {"role": "assistant", "content": step.content, "reasoning_content": step.reasoning}
    if step.tool_calls:
        message["tool_calls"] = tool_calls(step)
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": FINISH.get(step.finish_reason, "stop"),
                     "logprobs": _logprobs(step, decode)}],
        "usage": chat_usage(step), "conversation_id": step.conversation_id,
        "accounting": step.accounting.as_dict(),
    }


def build_router(runtime: Runtime, record_step, record_error, validate: Optional[str] = None) -> APIRouter:
    """`validate`: check each chat request as that provider does first (--validate)."""
    router = APIRouter(route_class=LeanRoute)  # the step routes' requests read lean (api/lean_route.py)
    upstream = runtime.backend.name == "upstream"
    created = int(time.time())
    answers = StepAnswers(runtime, record_step, record_error)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "session-runtime"}

    @router.get("/v1/models")
    def models() -> dict:
        """The model this server serves, under each name it is served as (the first first)."""
        return {"object": "list", "data": [card(name) for name in runtime.served_names]}

    @router.get("/v1/models/{model:path}")
    def model(model: str) -> dict:
        return card(served_name(runtime, model))

    @router.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request, caller: Caller = Depends(current_caller)):
        """A client that disconnects, plain or streamed, cancels the step."""
        if validate in CHAT_PROTOCOLS:  # a validating upstream: the provider's refusal, else answer it here
            refused = validation_error(validate, request_body(body))
            if refused is not None:
                return refused
            body = body.model_copy(update={"messages": answerable(body.messages), "model": None})
        return named(await cancellable(request, lambda cancel: complete(body, caller, cancel)))

    def complete(body: ChatRequest, caller: Caller, cancel):
        """The chat request's answer: a completion (dict), or a stream of chat
        chunks whose headers name the conversation."""
        if upstream and not body.conversation_id:  # the client's transcript, to the provider
            return proxy_completion(runtime.backend, request_body(body), record_step)
        model = runtime.served_names[0]
        if body.model is not None and not upstream:
            model = served_name(runtime, body.model)
        _refuse_unsupported(body)
        extra = body.model_extra or {}
        constraint = wire.chat(extra.get("tool_choice"), extra.get("response_format"), body.stop,
                               extra.get("reasoning_effort"))
        inp = StepInput(
            body.messages, body.tools,
            body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
            body.temperature, body.top_p, body.seed, body.logprobs, body.top_logprobs or 0, body.stream,
            body.conversation_id, body.create, body.replace, body.policy, constraint=constraint)
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        usage = bool((body.stream_options or {}).get("include_usage"))
        decode = runtime.tokenizer.decode

        def render(events):
            yield f"data: {json.dumps(_chunk('role', 'assistant', model, rid, usage))}\n\n"
            yield from sse_lines(events, lambda kind, value: _chunk(kind, value, model, rid, usage, decode))

        result = answers.answer(inp, caller, cancel, render)
        if isinstance(result, StreamingResponse):
            return result
        answer = completion(result, model, rid, decode)
        if validate == "deepseek":  # DeepSeek's own names for the cache figures
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
            answer["usage"].update(prompt_cache_hit_tokens=cached,
                                   prompt_cache_miss_tokens=answer["usage"]["prompt_tokens"] - cached)
        return answer

    router.answers = answers  # the other inbound protocols answer through it (api/protocol_routes.py)
    return router


def served_name(runtime: Runtime, model: object) -> str:
    """The served name a request asked for (`[1m]`, the long-context suffix
    Claude Code may add, ignored), which its answer carries. Raises
    ModelNotFound (404) for another model, InvalidRequest for a non-string."""
    if not isinstance(model, str):
        raise InvalidRequest("model: expected a string", param="model")
    name = runtime.served_name(model)
    if name is None:
        names = ", ".join(repr(n) for n in runtime.served_names)
        raise ModelNotFound(f"the model {model!r} does not exist: this server serves {names} (GET /v1/models)",
                            param="model")
    return name


def named(result):
    """A chat answer with its conversation named in CONVERSATION_HEADER."""
    if isinstance(result, dict) and result.get("conversation_id"):
        return JSONResponse(result, headers={CONVERSATION_HEADER: result["conversation_id"]})
    return result


def _chunk(kind: str, value: object, model: str, rid: str, usage: bool = False,
           decode: Optional[Callable[[list[int]], str]] = None) -> dict:
    """One SSE body in OpenAI's chat.completion.chunk shape. The step's final
    chunk carries the finish reason; with stream_options.include_usage the
    usage follows in a chunk with no choices, as OpenAI sends it."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    if kind == "role":
        return {**base, "choices": [{"index": 0, "delta": {"role": value, "content": ""}, "finish_reason": None}]}
    if kind == "reasoning":
        return {**base, "choices": [{"index": 0, "delta": {"reasoning_content": value}, "finish_reason": None}]}
    if kind == "content":
        return {**base, "choices": [{"index": 0, "delta": {"content": value}, "finish_reason": None}]}
    if kind == "error":
        return {"error": openai_body(value)[1]}
    step: Step = value
    delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls(step))]} if step.tool_calls else {}
    choice = {"index": 0, "delta": delta, "finish_reason": FINISH.get(step.finish_reason, "stop")}
    if step.logprobs is not None and decode is not None:
        choice["logprobs"] = _logprobs(step, decode)  # all of them, with the finish
    final = {**base, "choices": [choice],
             "conversation_id": step.conversation_id}
    if usage:
        final["usage"] = chat_usage(step)
    return final
