"""OpenAI Responses API: requests with `input` items and `instructions`,
responses with `output` items (their mapping to messages: responses_items.py),
the outbound rule, and the reasoning refusals detectable from a request.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from session_runtime.protocols.base import (
    ChatProtocol, ProtocolError, ProtocolInputError, StripOptions, StripResult, arrange, clone, dig, error_message,
    expect_ints, expect_list, expect_object, expect_str, is_int, last_index, openai_error, strip_result,
)
from session_runtime.protocols.canonical import ChatRequest, Msg, Reasoning, Reply, Usage
from session_runtime.protocols.responses_items import STRING_INPUT, parse_items, render_items, render_run, without_reasoning

NOT_PERSISTED = ("Item with id '{}' not found. Items are not persisted when `store` is set to false. Try again with "
                 "`store` set to true, or remove this item from your input.")
_KNOWN = ((404, "Items are not persisted when `store` is set to false", "openai-responses.item_not_found"),
          (400, "of type 'reasoning' was provided without its required following item",
           "openai-responses.reasoning_without_following_item"),
          (400, "was provided without its required 'reasoning' item", "openai-responses.reasoning_item_missing"))


class OpenAIResponses(ChatProtocol):
    name = "openai-responses"

    def parse_request(self, body: dict) -> ChatRequest:
        expect_object(body, "body")
        value = body.get("input")
        if isinstance(value, str):
            messages: tuple[Msg, ...] = (Msg("user", value, layout=(STRING_INPUT,)),)
        else:
            messages = parse_items(expect_list(value, "input"), "input") if "input" in body else ()
        listed = isinstance(body.get("tools"), list)
        params = {k: clone(v) for k, v in body.items() if k != "input" and not (k == "tools" and listed)}
        return ChatRequest(messages, tuple(clone(body["tools"])) if listed else (), params, tuple(body))

    def render_request(self, req: ChatRequest) -> dict:
        values = {k: clone(v) for k, v in req.params.items()}
        if len(req.messages) == 1 and req.messages[0].layout == (STRING_INPUT,):
            values["input"] = req.messages[0].content
        elif req.messages or "input" in req.layout or not req.layout:
            values["input"] = [item for m in req.messages for item in render_items(m)]
        if req.tools or ("tools" in req.layout and "tools" not in req.params):
            values["tools"] = clone(list(req.tools))
        return arrange(values, req.layout)

    # -- items ---------------------------------------------------------------

    # -- responses -----------------------------------------------------------

    def parse_response(self, body: dict) -> Reply:
        expect_object(body, "body")
        output = expect_list(body.get("output"), "output")
        messages = parse_items(output, "output") if output else (Msg("assistant", None),)
        if len(messages) != 1 or messages[0].role != "assistant":
            raise ProtocolInputError("output", "expected the items of one assistant turn")
        skip = ("id", "model", "output", "usage")
        extra = {k: clone(v) for k, v in body.items() if k not in skip}
        return Reply(messages[0], parse_usage(body.get("usage")), finish_of(extra, messages[0]),
                     expect_str(body.get("id", ""), "id"), extra=extra, layout=tuple(body))

    def render_response(self, reply: Reply, model: str) -> dict:
        extra = clone(reply.extra)
        if finish_of(extra, reply.message) != reply.finish_reason:
            extra["status"] = "incomplete" if reply.finish_reason in ("length", "content_filter") else "completed"
            extra["incomplete_details"] = {"reason": "max_output_tokens" if reply.finish_reason == "length"
                                           else "content_filter"} if extra["status"] == "incomplete" else None
        values: dict = {"id": reply.id}
        if not reply.layout:
            values.update({"object": "response", "created_at": int(time.time())})
        values.update({**extra, "model": model, "output": render_run(reply.message)})
        if reply.usage is not None or "usage" in reply.layout:
            values["usage"] = render_usage(reply.usage)
        return arrange(values, reply.layout)

    # -- outbound ------------------------------------------------------------

    def strip(self, req: ChatRequest, options: StripOptions) -> StripResult:
        """Reasoning items after the last user message (the current tool chain)
        are replayed in place, untouched. Earlier turns lose theirs, unless the
        context is "all_turns" (`options.context` or the request's
        `reasoning.context`) or `keep_tool_turns` covers a turn with calls;
        where a turn loses its reasoning, its function_call and message items
        lose their `fc_`/`msg_` ids too, since an item with an id must come
        with its reasoning item (the 400 "...without its required 'reasoning'
        item") while one without an id stands alone."""
        if options.passthrough:
            return StripResult(request=req, mode="passthrough")
        keep_all = "all_turns" in (options.context, dig(req.params, "reasoning", "context"))
        boundary = -1 if keep_all else last_index(req.messages, "user")
        out = list(req.messages)
        removed: dict[int, tuple[Reasoning, ...]] = {}
        for i in range(max(boundary, 0)):
            m = req.messages[i]
            if m.role == "assistant" and m.reasoning and not (options.keep_tool_turns and m.calls):
                out[i] = without_reasoning(m)
                removed[i] = m.reasoning
        return strip_result(dataclasses.replace(req, messages=tuple(out)), removed)

    # -- validation ----------------------------------------------------------

    def validate(self, body: dict) -> Optional[ProtocolError]:
        """A body it cannot read, and the reasoning refusals detectable from the
        request alone, first offending item first: with `store: false`, an
        item_reference or a reasoning item without encrypted_content (404: not
        persisted); a reasoning item with nothing of its turn after it (400);
        in a conversation with reasoning, a function_call or message item that
        carries an id with no reasoning item before it in its turn (400)."""
        try:
            req = self.parse_request(body)
        except ProtocolInputError as exc:
            return openai_error(400, "openai-responses.invalid_request", f"Invalid value for '{exc.path}': "
                                f"{exc.message}", param=exc.path, code="invalid_value")
        runs = [m for m in req.messages if m.role == "assistant"]
        effort = dig(req.params, "reasoning", "effort")
        reasoning_model = any(m.reasoning for m in runs) or effort in ("low", "medium", "high", "xhigh")
        for m in runs:
            items = render_run(m)
            for k, item in enumerate(items):
                kind, ident = item.get("type"), item.get("id")
                if req.params.get("store") is False and (
                        kind == "item_reference" or (kind == "reasoning" and not item.get("encrypted_content"))):
                    return openai_error(404, "openai-responses.item_not_found", NOT_PERSISTED.format(ident),
                                        param="input")
                if kind == "reasoning" and all(i.get("type") == "reasoning" for i in items[k:]):
                    return openai_error(400, "openai-responses.reasoning_without_following_item",
                                        f"Item '{ident}' of type 'reasoning' was provided without its required "
                                        "following item.", param="input")
                if reasoning_model and kind in ("function_call", "message") and isinstance(ident, str) and not any(
                        i.get("type") == "reasoning" for i in items[:k]):
                    return openai_error(400, "openai-responses.reasoning_item_missing",
                                        f"Item '{ident}' of type '{kind}' was provided without its required "
                                        "'reasoning' item: 'rs_unknown'.", param="input")
        return None

    def known_error(self, status: int, body: dict) -> Optional[str]:
        text = error_message(body)
        return next((name for code, needle, name in _KNOWN if status == code and needle in text), None)


def finish_of(extra: dict, msg: Msg) -> Optional[str]:
    status = extra.get("status")
    if status == "completed":
        return "tool_calls" if msg.calls else "stop"
    if status == "incomplete":
        reason = dig(extra, "incomplete_details", "reason")
        return "content_filter" if reason == "content_filter" else "length"
    return status


def parse_usage(raw: Any) -> Optional[Usage]:
    if raw is None:
        return None
    expect_object(raw, "usage")
    expect_ints(raw, ("input_tokens", "output_tokens"), "usage")
    cached, reasoning = dig(raw, "input_tokens_details", "cached_tokens"), dig(raw, "output_tokens_details",
                                                                               "reasoning_tokens")
    return Usage(raw["input_tokens"], raw["output_tokens"], cached if is_int(cached) else None,
                 reasoning if is_int(reasoning) else None, raw=clone(raw))


def render_usage(usage: Optional[Usage]) -> Optional[dict]:
    if usage is None:
        return None
    if usage.raw is not None and parse_usage(usage.raw) == usage:
        return clone(usage.raw)
    out: dict = {"input_tokens": usage.prompt_tokens}
    if usage.cached_input_tokens is not None:
        out["input_tokens_details"] = {"cached_tokens": usage.cached_input_tokens}
    out["output_tokens"] = usage.completion_tokens
    if usage.reasoning_tokens is not None:
        out["output_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    out["total_tokens"] = usage.prompt_tokens + usage.completion_tokens
    return out
