"""DeepSeek Chat Completions in thinking mode (`reasoning_content` on messages).

The outbound rules and the validator follow the seed's probes against the
live API (PROTOCOLS.md section 6): when the last message that is not `system`
is an assistant message (a draft continuation), the API checks strictly and
refuses the request if any assistant message lacks `reasoning_content`; in
every other ("lenient") shape it accepts any historical turn stripped, tool
calls included.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from session_runtime.protocols.base import (
    ProtocolError, ProtocolInputError, StripOptions, StripResult, error_message, openai_error,
)
from session_runtime.protocols.canonical import ChatRequest, Msg, Usage
from session_runtime.protocols.chat import ChatCompletions

ROLES = ("system", "user", "assistant", "tool")
REASONING_MISSING = "The `reasoning_content` in the thinking mode must be passed back to the API."
_V4_MISSING = re.compile(r"reasoning_content`? in the thinking mode must be passed back")
_V32_MISSING = re.compile(r"Missing `reasoning_content` field in the assistant message at message index (\d+)")
_ANTHROPIC_MISSING = "The content[].thinking in the thinking mode must be passed back to the API"


def strict_shape(messages: tuple[Msg, ...]) -> bool:
    """True when the last message whose role is not `system` is `assistant`."""
    last = last_non_system(messages)
    return last >= 0 and messages[last].role == "assistant"


def last_non_system(messages: tuple[Msg, ...]) -> int:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role != "system"), -1)


def thinking_enabled(params: dict) -> bool:
    """Thinking mode: `thinking: {type: enabled}`, or `deepseek-reasoner` unless
    `thinking: {type: disabled}` says otherwise."""
    thinking = params.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "disabled"):
        return kind == "enabled"
    return params.get("model") == "deepseek-reasoner"


class DeepSeek(ChatCompletions):
    name = "deepseek"
    reasoning_fields = ("reasoning_content",)
    cached_paths = (("prompt_cache_hit_tokens",), ("prompt_tokens_details", "cached_tokens"))
    error_code = "invalid_request_error"  # DeepSeek repeats the type as the code

    def cached_fields(self, usage: Usage) -> dict:
        return {"prompt_cache_hit_tokens": usage.cached_input_tokens,
                "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_input_tokens}

    def strip(self, req: ChatRequest, options: StripOptions) -> StripResult:
        """Passthrough sends `req` as it is. A strict shape (draft continuation)
        first has its trailing system messages rewritten to `user` (the nudge
        rewrite, unless `options.rewrite_nudge` is off); with none to rewrite
        it goes as it is, since stripping anything would draw the 400. Lenient
        shapes lose the reasoning of every assistant before the last user
        message; the open tool chain after it keeps its own."""
        if options.passthrough:
            return StripResult(request=req, mode="passthrough")
        messages = req.messages
        rewritten: tuple[int, ...] = ()
        if strict_shape(messages):
            rewritten = tuple(range(last_non_system(messages) + 1, len(messages)))
            if not rewritten or not options.rewrite_nudge:
                return StripResult(request=req, mode="strict")
            messages = tuple(dataclasses.replace(m, role="user") if i in rewritten else m
                             for i, m in enumerate(messages))
        return self.strip_lenient(req, messages, options, rewritten)

    def strict(self, messages: tuple[Msg, ...]) -> bool:
        return strict_shape(messages)

    def validate(self, body: dict) -> Optional[ProtocolError]:
        """The API's refusals: a body it cannot read, an unknown role, no
        messages, a tool result answering no call and, in thinking mode, a
        strict shape with any assistant message lacking `reasoning_content`
        (lenient shapes pass however stripped: the seed's V0-V4 and W1)."""
        error = self.shape_error(body)
        if error is not None:
            return error
        req = self.parse_request(body)
        for i, m in enumerate(req.messages):
            if m.role not in ROLES:
                return openai_error(400, "deepseek.invalid_request", self.unreadable(ProtocolInputError(
                    f"messages[{i}].role", f"unknown variant `{m.role}`, expected one of "
                    + ", ".join(f"`{r}`" for r in ROLES))), code=self.error_code)
        if thinking_enabled(req.params) and strict_shape(req.messages) and any(
                m.role == "assistant" and m.reasoning is None for m in req.messages):
            return openai_error(400, "deepseek.reasoning_content_missing", REASONING_MISSING,
                                code=self.error_code)
        return None

    def unreadable(self, exc: ProtocolInputError) -> str:
        return f"Failed to deserialize the JSON body into the target type: {exc.path}: {exc.message}"

    def known_error(self, status: int, body: dict) -> Optional[str]:
        """`deepseek.reasoning_content_missing` for the V4 text and the V3.2
        "at message index N" text; `deepseek.thinking_missing` for the
        Anthropic-format endpoint's."""
        if status != 400:
            return None
        text = error_message(body)
        if _V4_MISSING.search(text) or _V32_MISSING.search(text):
            return "deepseek.reasoning_content_missing"
        if _ANTHROPIC_MISSING in text:
            return "deepseek.thinking_missing"
        return None
