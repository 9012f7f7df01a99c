"""Anthropic Messages: `thinking` and `redacted_thinking` blocks with their
signatures, `tool_use` blocks, `tool_result` blocks inside user messages and
a top-level `system` (a string or blocks, kept in params).

An assistant message's blocks are split into reasoning (thinking and redacted
thinking, each block verbatim in `opaque`), calls (tool_use, the block in
`opaque`) and content (every other block, verbatim); `layout` records their
order, so interleaved thinking (thinking, tool_use, thinking, tool_use, text)
renders back in place. User messages, tool results included, stay as they
are: `convert.to_chat` splits them for another protocol.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from session_runtime.protocols.base import (
    ChatProtocol, MessagesHistory, ProtocolError, ProtocolInputError, StripOptions, StripResult, arrange, clone, dig,
    known_400, expect_ints, expect_list, expect_object, expect_str, is_int, parse_messages_request,
    render_messages_request,
)
from session_runtime.protocols.canonical import Call, ChatRequest, Msg, Reasoning, Reply, Usage

REASONING_BLOCKS = ("thinking", "redacted_thinking")
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
           "refusal": "content_filter", "model_context_window_exceeded": "length", "pause_turn": "pause_turn"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal",
         "pause_turn": "pause_turn"}
_KNOWN = (("a final `assistant` message must start with a thinking block", "anthropic.thinking_block_required"),
          ("Invalid `signature` in `thinking` block", "anthropic.invalid_signature"),
          ("When thinking is disabled, an `assistant` message in the final position cannot contain `thinking`",
           "anthropic.thinking_when_disabled"),
          ("The content[].thinking in the thinking mode must be passed back to the API", "anthropic.thinking_missing"))
_DOCS = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"


def thinking_enabled(params: dict) -> bool:
    thinking = params.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def has_tool_results(msg: Msg) -> bool:
    """A user message that carries tool results (the open tool chain goes on through it)."""
    return msg.role == "user" and isinstance(msg.content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in msg.content)


def dotted(path: str) -> str:
    """`messages[3].content[0]` as Anthropic writes it: `messages.3.content.0`."""
    return path.replace("[", ".").replace("]", "")


class Anthropic(MessagesHistory, ChatProtocol):
    name = "anthropic"

    def parse_request(self, body: dict) -> ChatRequest:
        return parse_messages_request(body, self._parse_known)

    def render_request(self, req: ChatRequest) -> dict:
        return render_messages_request(req, self._render_known)

    def parse_message(self, m: Any, path: str) -> Msg:
        expect_object(m, path)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ProtocolInputError(f"{path}.role", f"unknown role {role!r}; expected user or assistant")
        extra = {k: clone(v) for k, v in m.items() if k not in ("role", "content")}
        content = m.get("content")
        if isinstance(content, str) or role == "user":
            if not isinstance(content, (str, list)):
                raise ProtocolInputError(f"{path}.content", "expected a string or an array of content blocks")
            return Msg(role, clone(content), extra=extra)
        return self.parse_blocks(expect_list(content, f"{path}.content"), f"{path}.content", extra)

    @staticmethod
    def parse_blocks(blocks: list, path: str, extra: Optional[dict] = None) -> Msg:
        """An assistant message of content blocks, split into reasoning, calls and content."""
        reasoning: list[Reasoning] = []
        calls: list[Call] = []
        content: list = []
        layout: list[str] = []
        for j, block in enumerate(blocks):
            where = f"{path}[{j}]"
            kind = expect_object(block, where).get("type")
            if kind == "thinking":
                reasoning.append(Reasoning(expect_str(block.get("thinking"), f"{where}.thinking"), clone(block)))
            elif kind == "redacted_thinking":
                expect_str(block.get("data"), f"{where}.data")
                reasoning.append(Reasoning("", clone(block)))
            elif kind == "tool_use":
                arguments = json.dumps(expect_object(block.get("input"), f"{where}.input"), ensure_ascii=False)
                calls.append(Call(expect_str(block.get("id"), f"{where}.id"),
                                  expect_str(block.get("name"), f"{where}.name"), arguments, clone(block)))
            else:
                expect_str(kind, f"{where}.type")
                content.append(clone(block))
            layout.append("reasoning" if kind in REASONING_BLOCKS else "call" if kind == "tool_use" else "content")
        return Msg("assistant", content, tuple(reasoning) if reasoning else None, tuple(calls),
                   extra=extra or {}, layout=tuple(layout))

    def render_message(self, msg: Msg) -> dict:
        if msg.role != "assistant" or (isinstance(msg.content, str) and msg.reasoning is None and not msg.calls):
            return {"role": msg.role, "content": clone(msg.content), **clone(msg.extra)}
        return {"role": "assistant", "content": render_blocks(msg), **clone(msg.extra)}

    # -- responses ---------------------------------------------------------

    def parse_response(self, body: dict) -> Reply:
        expect_object(body, "body")
        message = self.parse_blocks(expect_list(body.get("content"), "content"), "content")
        stop = body.get("stop_reason")
        skip = ("id", "model", "role", "content", "usage")
        return Reply(message=message, usage=parse_usage(body.get("usage")),
                     finish_reason=None if stop is None else _FINISH.get(stop, stop),
                     id=expect_str(body.get("id", ""), "id"),
                     extra={k: clone(v) for k, v in body.items() if k not in skip}, layout=tuple(body))

    def render_response(self, reply: Reply, model: str) -> dict:
        stop = reply.extra.get("stop_reason")
        if stop is None or _FINISH.get(stop, stop) != reply.finish_reason:
            stop = None if reply.finish_reason is None else _STOP.get(reply.finish_reason, reply.finish_reason)
        values = {"id": reply.id, "type": "message", "role": "assistant", "model": model,
                  "content": render_blocks(reply.message), **clone(reply.extra), "stop_reason": stop}
        if not reply.layout:
            values.setdefault("stop_sequence", None)
        if reply.usage is not None or "usage" in reply.layout:
            values["usage"] = render_usage(reply.usage)
        return arrange(values, reply.layout)

    # -- outbound ----------------------------------------------------------

    def strip(self, req: ChatRequest, options: StripOptions) -> StripResult:
        """Every assistant message after the last user message without tool
        results (the open tool chain, whose last message Anthropic wants
        echoed exactly) keeps its blocks untouched. Earlier ones lose their
        thinking and redacted_thinking blocks (`strips`), unless `options.context`
        is "all_turns" (preserved-thinking models bind signatures to the prefix)."""
        if options.passthrough:
            return StripResult(request=req, mode="passthrough")
        return self.strip_history(req, req.messages, self.history_boundary(req.messages, options), options)

    def history_boundary(self, messages: tuple[Msg, ...], options: StripOptions) -> int:
        """The last user message that is not tool results (0, none, under "all_turns")."""
        if options.context == "all_turns":
            return 0
        return max(next((i for i in range(len(messages) - 1, -1, -1)
                         if messages[i].role == "user" and not has_tool_results(messages[i])), -1), 0)

    @staticmethod
    def strips(m: Msg, options: StripOptions) -> bool:
        """An assistant message's thinking goes, unless `keep_tool_turns` covers a
        tool_use turn, or nothing would be left (an empty message is refused)."""
        return (m.role == "assistant" and bool(m.reasoning) and not (options.keep_tool_turns and m.calls)
                and bool(m.calls or m.content))

    # -- validation --------------------------------------------------------

    def validate(self, body: dict) -> Optional[ProtocolError]:
        """A body it cannot read, no messages, and the two thinking refusals:
        with thinking on, the assistant turn before the final tool results must
        start with a thinking block; with it off, a final assistant message
        must hold none."""
        try:
            req = self.parse_request(body)
        except ProtocolInputError as exc:
            return error(f"{dotted(exc.path)}: {exc.message}", "anthropic.invalid_request")
        if not req.messages:
            return error("messages: at least one message is required", "anthropic.invalid_request")
        wire, last = body["messages"], len(req.messages) - 1
        if thinking_enabled(req.params):
            turn = last - 1  # the assistant turn answered by the final tool results
            if turn >= 0 and has_tool_results(req.messages[last]) and req.messages[turn].calls:
                first = wire[turn]["content"][0]["type"]
                if first not in REASONING_BLOCKS:
                    return error(f"messages.{turn}.content.0.type: Expected `thinking` or `redacted_thinking`, but "
                                 f"found `{first}`. When `thinking` is enabled, a final `assistant` message must start "
                                 "with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` "
                                 "blocks). We recommend you include thinking blocks from previous turns. To avoid this "
                                 f"requirement, disable `thinking`. Please consult our documentation at {_DOCS}",
                                 "anthropic.thinking_block_required")
        elif req.messages[last].role == "assistant" and isinstance(wire[last]["content"], list):
            j = next((j for j, b in enumerate(wire[last]["content"]) if b["type"] in REASONING_BLOCKS), None)
            if j is not None:
                return error(f"messages.{last}.content.{j}: When thinking is disabled, an `assistant` message in the "
                             "final position cannot contain `thinking`. To use thinking blocks, enable `thinking` in "
                             "your request.", "anthropic.thinking_when_disabled")
        return None

    def known_error(self, status: int, body: dict) -> Optional[str]:
        return known_400(status, body, _KNOWN)


def render_blocks(msg: Msg) -> list:
    """An assistant message's content blocks in its layout (hand-built:
    thinking, then content, then tool_use). Reasoning blocks go back verbatim;
    without continuation state a block carries no signature."""
    queues = {"reasoning": [r.opaque if r.opaque is not None else {"type": "thinking", "thinking": r.text}
                            for r in msg.reasoning or ()],
              "content": list(msg.content) if isinstance(msg.content, list) else
              [{"type": "text", "text": msg.content}] if msg.content else [],
              "call": [render_call(c) for c in msg.calls]}
    out = [queues[slot].pop(0) for slot in msg.layout if queues[slot]]
    for slot in ("reasoning", "content", "call"):
        out += queues[slot]
    return clone(out)


def render_call(c: Call) -> dict:
    """A tool_use block: the wire block with id and name overwritten; its
    `input` object goes back as it came while `arguments` still says it."""
    if c.opaque is not None and json.dumps(c.opaque.get("input"), ensure_ascii=False) == c.arguments:
        value = c.opaque["input"]
    else:
        try:
            value = json.loads(c.arguments) if c.arguments.strip() else {}
        except json.JSONDecodeError:
            raise ProtocolInputError(f"calls[{c.id}].arguments", "not JSON; a tool_use input must be an object")
    if c.opaque is None:
        return {"type": "tool_use", "id": c.id, "name": c.name, "input": value}
    return {**c.opaque, "id": c.id, "name": c.name, "input": value}


def parse_usage(raw: Any) -> Optional[Usage]:
    """Anthropic's usage; `prompt_tokens` adds the cache reads and writes to
    `input_tokens` (which counts only the uncached rest)."""
    if raw is None:
        return None
    expect_object(raw, "usage")
    expect_ints(raw, ("input_tokens", "output_tokens"), "usage")
    read, write = raw.get("cache_read_input_tokens"), raw.get("cache_creation_input_tokens")
    prompt = raw["input_tokens"] + (read if is_int(read) else 0) + (write if is_int(write) else 0)
    thinking = dig(raw, "output_tokens_details", "thinking_tokens")
    return Usage(prompt, raw["output_tokens"], read if is_int(read) else None,
                 thinking if is_int(thinking) else None, raw=clone(raw))


def render_usage(usage: Optional[Usage]) -> Optional[dict]:
    if usage is None:
        return None
    if usage.raw is not None and parse_usage(usage.raw) == usage:
        return clone(usage.raw)
    out = {"input_tokens": usage.prompt_tokens - (usage.cached_input_tokens or 0), "output_tokens": usage.completion_tokens}
    if usage.cached_input_tokens is not None:
        out["cache_read_input_tokens"] = usage.cached_input_tokens
    if usage.reasoning_tokens is not None:
        out["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
    return out


def error(message: str, name: str, status: int = 400) -> ProtocolError:
    """An error in Anthropic's body shape."""
    return ProtocolError(status, {"type": "error", "error": {"type": "invalid_request_error", "message": message}}, name)
