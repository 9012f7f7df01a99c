"""Anthropic's streaming events for `POST /v1/messages` with `stream: true`,
rendered from the step's typed events (api/streaming.py: prefill, reasoning
and content deltas, the step or an error).

The sequence, as Anthropic sends it: `message_start` (the message with an
empty content and the usage known so far), `ping`, then per content block
`content_block_start`, its deltas and `content_block_stop`, then
`message_delta` (stop_reason and the final usage) and `message_stop`.
Reasoning deltas become a `thinking` block whose last delta is a
`signature_delta` (the server's signature of its whole text), content deltas a
`text` block, the step's tool calls `tool_use` blocks with an
`input_json_delta`. An error after the stream started is Anthropic's
`event: error`; one before it never reaches here (the step raises it, and the
error handlers answer it).

`message_start` is sent once the step's prompt is matched and prefilled (the
prefill event), so it carries the real `input_tokens` (uncached),
`cache_read_input_tokens` and `cache_creation_input_tokens` (0: the three sum to
the prompt), as Claude Code's context display reads them there; `message_delta` repeats them with the
output tokens.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator, Optional

from session_runtime.api.openai_compat import FINISH, tool_calls
from session_runtime.api.protocol_routes import new_id
from session_runtime.api.streaming import Event, Prefill
from session_runtime.step import Step

# OpenAI's finish_reason -> Anthropic's stop_reason.
STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
# The chat route's error codes (the session API's kinds) that are Anthropic's
# "overloaded" (worth a retry later) or "rate limited".
_OVERLOADED = {"pool_exhausted", "backend_unavailable", "unavailable", "storage_unavailable", "storage_full",
               "upstream_unavailable"}
_RATE_LIMITED = {"conversation_limit", "storage_limit"}
_ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                    "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _input_usage(prompt: int, cached: int) -> dict:
    # The three input figures sum to the prompt, as Anthropic's do.
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def step_usage(step: Step) -> dict:
    """A step's usage in Anthropic's names: `input_tokens` is the uncached
    part of the prompt, `cache_read_input_tokens` the part reused from the
    cache (device or host), and the reasoning tokens
    `output_tokens_details.thinking_tokens`."""
    acc = step.accounting
    cached = (acc.cached_input_tokens or 0) + acc.host_loaded_tokens
    return {**_input_usage(acc.prompt_tokens, cached), "output_tokens": acc.output_tokens,
            "output_tokens_details": {"thinking_tokens": step.reasoning_tokens}}


def error_event(error: dict) -> str:
    """The chat route's late error (OpenAI's error object) as Anthropic's `error` event."""
    code, kind = error.get("code"), error.get("type")
    if code in _OVERLOADED:
        kind = "overloaded_error"
    elif code in _RATE_LIMITED:
        kind = "rate_limit_error"
    elif kind not in _ANTHROPIC_TYPES:
        kind = "api_error"  # OpenAI's server_error, and anything else
    return sse("error", {"type": "error", "error": {"type": kind, "message": str(error.get("message", ""))}})


class Translator:
    """One stream's state: the open content block, the thinking text it has
    sent (to sign at the block's end), the finish reason and usage. `chunk`
    and `end` return the SSE events to send."""

    def __init__(self, message_id: str, model: str, sign: Callable[[str], str],
                 context_management: Optional[dict] = None):
        self.message_id, self.model, self.sign = message_id, model, sign
        self.context_management = context_management  # the edits applied, for the final message_delta
        self.index = -1  # of the open block; -1 before the first
        self.kind: Optional[str] = None  # the open block's type; None when none is open
        self.thinking = ""
        self.finish: Optional[str] = None
        self.stop_sequence: Optional[str] = None
        self.usage: Optional[dict] = None
        self.failed = False

    def start(self, prefill: Optional[Prefill]) -> list[str]:
        """message_start (with the prompt's usage when the prefill is known) and a ping."""
        usage = _input_usage(prefill.prompt_tokens, prefill.cached_tokens) if prefill else _input_usage(0, 0)
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
        return [sse("message_start", {"type": "message_start", "message": message}), sse("ping", {"type": "ping"})]

    def render(self, events: Iterator[Event]) -> Iterator[str]:
        """Anthropic's SSE events for the step's typed events."""
        started = False
        for kind, value in events:
            if not started:
                yield from self.start(value if kind == "prefill" else None)
                started = True
            if kind == "reasoning":
                yield from self._delta("thinking", {"type": "thinking_delta", "thinking": value})
                self.thinking += value
            elif kind == "content":
                yield from self._delta("text", {"type": "text_delta", "text": value})
            elif kind == "error":
                yield error_event({"code": value.kind, "message": value.message,
                                   "type": "invalid_request_error" if value.status < 500 else "api_error"})
                return
            elif kind == "step":
                for call in tool_calls(value):
                    yield from self._tool_call(call)
                self.finish = FINISH.get(value.finish_reason, "stop")
                self.stop_sequence = value.stop_sequence
                self.usage = step_usage(value)
        yield from self.end()

    def end(self) -> list[str]:
        """The closing events; an `error` event instead when the chat stream
        ended without a finish (it never does unless cut short)."""
        if self.failed:
            return []
        if self.finish is None:
            return [error_event({"type": "api_error", "message": "the stream ended before the answer did"})]
        stop = "stop_sequence" if self.stop_sequence is not None else STOP_REASON.get(self.finish, "end_turn")
        delta = {"stop_reason": stop, "stop_sequence": self.stop_sequence}
        final = {"type": "message_delta", "delta": delta, "usage": self.usage}
        if self.context_management is not None:
            final["context_management"] = self.context_management
        return self._close() + [sse("message_delta", final),
                                sse("message_stop", {"type": "message_stop"})]

    def _delta(self, kind: str, delta: dict) -> list[str]:
        out = []
        if self.kind != kind:
            out += self._open({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                              else {"type": "text", "text": ""})
        return out + [sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def _tool_call(self, call: dict) -> list[str]:
        """A call's first chunk (it has the id) opens a tool_use block; its
        arguments, whole or in pieces, are that block's input_json_deltas.
        The conversation's own toolu_ ids go out as they are (the client sends
        them back with the results); any other id is replaced."""
        out = []
        if call.get("id") or self.kind != "tool_use":
            name = (call.get("function") or {}).get("name") or ""
            cid = call.get("id") or ""
            out += self._open({"type": "tool_use", "id": cid if cid.startswith("toolu_") else new_id("toolu_"),
                               "name": name, "input": {}})
        arguments = (call.get("function") or {}).get("arguments")
        if arguments:
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return out

    def _open(self, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        return out + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":  # the signature covers the block's whole text, so it comes last
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "signature_delta",
                                                             "signature": self.sign(self.thinking)}}))
            self.thinking = ""
        self.kind = None
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]
