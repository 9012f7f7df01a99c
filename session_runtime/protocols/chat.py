"""Chat Completions bodies, shared by the DeepSeek and OpenAI-compatible adapters.

The two differ in the names of the reasoning field (`reasoning_content`; vLLM
and SGLang also write `reasoning`), in where usage reports cached tokens, and
in their outbound and validation rules, which live in their own modules.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from session_runtime.protocols.base import (
    ChatProtocol, MessagesHistory, ProtocolError, ProtocolInputError, StripOptions, StripResult, arrange, clone, dig,
    expect_list, expect_object, expect_str, is_int, last_index, openai_error, parse_messages_request,
    render_messages_request,
)
from session_runtime.protocols.canonical import ROLES, Call, ChatRequest, Msg, Reasoning, Reply, Usage, reasoning_text

_MODELLED = ("role", "content", "tool_calls", "tool_call_id")


class ChatCompletions(MessagesHistory, ChatProtocol):
    """Chat Completions: the parsing, rendering and lenient stripping both
    chat adapters share. Subclasses name their reasoning fields (the first is
    the one a hand-built message is rendered with) and cached-token fields."""

    reasoning_fields: tuple[str, ...] = ("reasoning_content",)
    cached_paths: tuple[tuple[str, ...], ...] = (("prompt_tokens_details", "cached_tokens"),)
    error_code: Optional[str] = None  # the `code` of the server's 400 bodies

    # -- requests ----------------------------------------------------------

    def parse_request(self, body: dict) -> ChatRequest:
        return parse_messages_request(body, self._parse_known)

    def render_request(self, req: ChatRequest) -> dict:
        return render_messages_request(req, self._render_known)

    # -- messages ----------------------------------------------------------

    def parse_message(self, m: Any, path: str) -> Msg:
        """One wire message. Content, unknown fields and the call objects are
        kept verbatim; a reasoning field that is null stays in `extra`."""
        expect_object(m, path)
        role = m.get("role")
        if role not in ROLES:
            raise ProtocolInputError(f"{path}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, (str, list, type(None))):
            raise ProtocolInputError(f"{path}.content", "expected a string, an array of content parts or null")
        extra: dict = {}
        reasoning: Optional[str] = None
        for name in self.reasoning_fields:
            value = m.get(name)
            if value is None or (reasoning is not None and value == reasoning):
                continue  # absent, null (kept below as extra) or a copy of the first
            expect_str(value, f"{path}.{name}")
            if reasoning is None:
                reasoning = value
            else:
                extra[name] = value  # a second, different reasoning text: verbatim
        calls: tuple[Call, ...] = ()
        if m.get("tool_calls") is not None:
            calls = tuple(self.parse_call(c, f"{path}.tool_calls[{j}]")
                          for j, c in enumerate(expect_list(m["tool_calls"], f"{path}.tool_calls")))
        call_id = m.get("tool_call_id")
        if call_id is not None:
            expect_str(call_id, f"{path}.tool_call_id")
        for key, value in m.items():
            if key in self.reasoning_fields:
                if value is None:
                    extra[key] = None
            elif key not in _MODELLED or value is None and key in ("tool_calls", "tool_call_id"):
                extra[key] = clone(value)
        return Msg(role=role, content=clone(content), reasoning=None if reasoning is None else (Reasoning(reasoning),),
                   calls=calls, call_id=call_id, extra=extra, layout=tuple(m))

    @staticmethod
    def parse_call(c: Any, path: str) -> Call:
        expect_object(c, path)
        function = expect_object(c.get("function"), f"{path}.function")
        return Call(id=expect_str(c.get("id"), f"{path}.id"),
                    name=expect_str(function.get("name"), f"{path}.function.name"),
                    arguments=expect_str(function.get("arguments"), f"{path}.function.arguments"),
                    opaque=clone(c))

    def render_message(self, msg: Msg) -> dict:
        values: dict = {"role": msg.role}
        if not msg.layout or "content" in msg.layout or msg.content is not None:
            values["content"] = clone(msg.content)
        if msg.reasoning is not None:
            text = reasoning_text(msg)
            names = [n for n in self.reasoning_fields if n in msg.layout and n not in msg.extra]
            for name in names or [self.reasoning_fields[0]]:
                values[name] = text
        if msg.calls or ("tool_calls" in msg.layout and "tool_calls" not in msg.extra):
            values["tool_calls"] = [render_call(c) for c in msg.calls]
        if msg.call_id is not None:
            values["tool_call_id"] = msg.call_id
        values.update((k, clone(v)) for k, v in msg.extra.items())
        return arrange(values, msg.layout)

    def _without_reasoning(self, msg: Msg) -> Msg:  # its reasoning fields too
        extra = {k: v for k, v in msg.extra.items() if not (k in self.reasoning_fields and isinstance(v, str))}
        return dataclasses.replace(msg, reasoning=None, extra=extra)

    # -- responses ---------------------------------------------------------

    def parse_response(self, body: dict) -> Reply:
        expect_object(body, "body")
        choices = expect_list(body.get("choices"), "choices")
        if len(choices) != 1:
            raise ProtocolInputError("choices", f"expected exactly one choice (n=1), got {len(choices)}")
        choice = expect_object(choices[0], "choices[0]")
        message = self.parse_message(choice.get("message"), "choices[0].message")
        finish = choice.get("finish_reason")
        if finish is not None:
            expect_str(finish, "choices[0].finish_reason")
        ident = body.get("id", "")
        expect_str(ident, "id")
        skip = ("id", "model", "choices", "usage")
        return Reply(message=message, usage=self.parse_usage(body.get("usage"), "usage"), finish_reason=finish,
                     id=ident, extra={k: clone(v) for k, v in body.items() if k not in skip},
                     choice_extra={k: clone(v) for k, v in choice.items() if k not in ("message", "finish_reason")},
                     layout=tuple(body) + tuple(f"choice.{k}" for k in choice))

    def render_response(self, reply: Reply, model: str) -> dict:
        top = [k for k in reply.layout if not k.startswith("choice.")]
        in_choice = tuple(k[len("choice."):] for k in reply.layout if k.startswith("choice."))
        choice = arrange({"index": 0, **clone(reply.choice_extra), "message": self.render_message(reply.message),
                          "finish_reason": reply.finish_reason}, in_choice)
        values: dict = {"id": reply.id}
        if not reply.layout:
            values.update({"object": "chat.completion", "created": int(time.time())})
        values.update({**clone(reply.extra), "model": model, "choices": [choice]})
        if reply.usage is not None or "usage" in top:
            values["usage"] = self.render_usage(reply.usage)
        return arrange(values, tuple(top))

    # -- usage -------------------------------------------------------------

    def parse_usage(self, raw: Any, path: str) -> Optional[Usage]:
        if raw is None:
            return None
        expect_object(raw, path)
        figures = {}
        for key in ("prompt_tokens", "completion_tokens"):
            if not is_int(raw.get(key)):
                raise ProtocolInputError(f"{path}.{key}", "expected an integer")
            figures[key] = raw[key]
        cached = next((v for v in (dig(raw, *p) for p in self.cached_paths) if is_int(v)), None)
        reasoning = dig(raw, "completion_tokens_details", "reasoning_tokens")
        return Usage(figures["prompt_tokens"], figures["completion_tokens"], cached,
                     reasoning if is_int(reasoning) else None, raw=clone(raw))

    def render_usage(self, usage: Optional[Usage]) -> Optional[dict]:
        """The provider's own usage object while it still says what `usage`
        says, else one written from the fields."""
        if usage is None:
            return None
        if usage.raw is not None and self.parse_usage(usage.raw, "usage") == usage:
            return clone(usage.raw)
        out: dict = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                     "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        if usage.cached_input_tokens is not None:
            out.update(self.cached_fields(usage))
        if usage.reasoning_tokens is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
        return out

    def cached_fields(self, usage: Usage) -> dict:
        return {"prompt_tokens_details": {"cached_tokens": usage.cached_input_tokens}}

    # -- outbound ----------------------------------------------------------

    def strip(self, req: ChatRequest, options: StripOptions) -> StripResult:
        """Lenient stripping (no strict shape): see `strip_lenient`."""
        if options.passthrough:
            return StripResult(request=req, mode="passthrough")
        return self.strip_lenient(req, req.messages, options)

    def strip_lenient(self, req: ChatRequest, messages: tuple[Msg, ...], options: StripOptions,
                      rewritten: tuple[int, ...] = ()) -> StripResult:
        """Every assistant message before the last user message loses its
        reasoning (with `keep_tool_turns`, those that made tool calls keep it);
        the open tool chain after it keeps everything."""
        return self.strip_history(req, messages, last_index(messages, "user"), options, rewritten)

    @staticmethod
    def strips(m: Msg, options: StripOptions) -> bool:
        """Whether `m`, a message before the last user message, loses its reasoning (the lenient rule)."""
        return m.role == "assistant" and m.reasoning is not None and not (options.keep_tool_turns and m.calls)

    def strict(self, messages: tuple[Msg, ...]) -> bool:
        """Whether a history's shape demands that every reasoning block goes back (none here)."""
        return False

    def history_boundary(self, messages: tuple[Msg, ...], options: StripOptions) -> Optional[int]:
        """The last user message (None for a strict shape: stripped whole)."""
        return None if self.strict(messages) else max(last_index(messages, "user"), 0)

    # -- validation --------------------------------------------------------

    def shape_error(self, body: dict) -> Optional[ProtocolError]:
        """The basic refusals every Chat Completions server makes: a body it
        cannot read, no messages, a tool result answering no call."""
        try:
            req = self.parse_request(body)
        except ProtocolInputError as exc:
            return openai_error(400, f"{self.name}.invalid_request", self.unreadable(exc), param=exc.path,
                                code=self.error_code)
        if not req.messages:
            return openai_error(400, f"{self.name}.invalid_request", "Invalid 'messages': empty array. Expected an "
                                "array with minimum length 1, but got an empty array instead.", param="messages",
                                code=self.error_code)
        return tool_result_error(self.name, req.messages, self.error_code)

    def unreadable(self, exc: ProtocolInputError) -> str:
        return f"Invalid value for '{exc.path}': {exc.message}"


def render_call(c: Call) -> dict:
    """A chat tool call: the wire object with its modelled fields overwritten."""
    if c.opaque is None:
        return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    out = clone(c.opaque)
    out["id"] = c.id
    out["function"] = {**(out.get("function") or {}), "name": c.name, "arguments": c.arguments}
    return out


def tool_result_error(name: str, messages: tuple[Msg, ...], code: Optional[str] = None) -> Optional[ProtocolError]:
    """OpenAI's refusal of a tool message that has no tool_call_id or does not
    answer a call of the assistant message its run of tool messages follows."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            open_calls = {c.id for c in m.calls}
        elif m.role == "tool":
            if m.call_id is None:
                return openai_error(400, f"{name}.tool_call_id_missing", "Missing parameter 'tool_call_id': messages "
                                    "with role 'tool' must have a 'tool_call_id'.", param=f"messages.[{i}].tool_call_id",
                                    code=code)
            if m.call_id not in open_calls:
                return openai_error(400, f"{name}.tool_message_orphan", "Invalid parameter: messages with role 'tool' "
                                    "must be a response to a preceeding message with 'tool_calls'.",
                                    param=f"messages.[{i}].role", code=code)
        else:
            open_calls = set()
    return None
