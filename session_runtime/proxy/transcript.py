"""A conversation's trace as a provider's request body, and a provider's
answer as what the runtime records.

The trace keeps every reasoning block; the body built here carries all of it
(the stripper in outbound.py decides what leaves). An assistant message that
came from the same provider goes back as it came (`Message.wire`), so its
continuation state (signatures, encrypted reasoning, item and call ids,
`content: null`) is byte-identical; one from elsewhere (a local history, an
imported one) is written from its fields.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.protocols.anthropic import thinking_enabled
from session_runtime.protocols.base import CHAT_PROTOCOLS  # a client's "chat" wire goes to either as it is
from session_runtime.protocols.canonical import Reply, reasoning_text
from session_runtime.proxy.prefix import OutboundPrefix
from session_runtime.templates.base import Message, ToolCall, tool_schema
from session_runtime.weak_memo import WeakMemo, WireMessage

# The provider's finish reasons that mean the token budget ran out.
_LENGTH = {"length", "max_tokens", "max_output_tokens", "incomplete"}


@dataclass(frozen=True)
class ReplyParts:
    """A provider's answer as the runtime records it."""

    reasoning: str
    content: str
    calls: tuple[ToolCall, ...]  # the provider's call ids
    wire: str  # {"protocol", "message"} JSON: what goes back next time, verbatim
    finish_reason: str  # stop or length


def wire_of(protocol: str, message: Message) -> Optional[object]:
    """The provider's own form of an assistant message, when it came from `protocol`."""
    if not message.wire:
        return None
    stored = json.loads(message.wire)
    same = stored.get("protocol") == protocol or (stored.get("protocol") == "chat" and protocol in CHAT_PROTOCOLS)
    return stored["message"] if same else None


def request_body(protocol: str, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
                 params: dict, prefix: Optional[OutboundPrefix] = None) -> dict:
    """The request body of `protocol` for a conversation (reasoning included).
    `params` are top-level fields (model, max_tokens, temperature, ...) in that
    protocol's names. `prefix`: the conversation's last request (Chat
    Completions protocols), so that only messages past it are built."""
    if protocol in CHAT_PROTOCOLS:
        return _chat(protocol, system, list(tools), messages, dict(params), prefix)
    build = {"anthropic": _anthropic, "openai-responses": _responses}
    return build[protocol](protocol, system, list(tools), list(messages), dict(params))


_CHAT_WIRE = {name: WeakMemo() for name in CHAT_PROTOCOLS}


def _chat(protocol, system, tools, messages, params, prefix: Optional[OutboundPrefix]) -> dict:
    """Chat Completions: one wire message per stored message, each built once
    for as long as the stored message lives (`WeakMemo`); with the
    conversation's `prefix`, only those past its last request are even looked up."""
    memo = _CHAT_WIRE[protocol]
    build = functools.partial(_chat_message, protocol)
    if prefix is None:
        out = [{"role": "system", "content": system}] if system else []
        out += [memo.get(m, build) for m in messages]
    else:
        out = [prefix.system_message(system, lambda text: WireMessage(role="system", content=text))] if system else []
        out += prefix.wire.map(messages, lambda _, m: memo.get(m, build))
    body = {**params, "messages": out}
    if tools:
        body["tools"] = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    return body


def _chat_message(protocol: str, m: Message) -> WireMessage:
    if m.role == "user":
        return WireMessage(role="user", content=m.content)
    if m.role == "tool":
        return WireMessage(role="tool", tool_call_id=m.tool_call_id, content=m.content)
    wire = wire_of(protocol, m)
    if wire is None:
        wire = {"role": "assistant", "content": m.content, "reasoning_content": m.reasoning}
        if m.tool_calls:
            wire["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in m.tool_calls]
    return WireMessage(wire)


def _anthropic(protocol, system, tools, messages, params) -> dict:
    out: list[dict] = []
    for m in messages:
        if m.role == "user":
            out.append({"role": "user", "content": m.content})
        elif m.role == "tool":  # a run of results is one user message of tool_result blocks
            block = {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list) and all(
                    b.get("type") == "tool_result" for b in out[-1]["content"]):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            wire = wire_of(protocol, m)
            if wire is None:  # thinking without its signature cannot go back: text and calls only
                blocks = [{"type": "text", "text": m.content}] if m.content else []
                blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in m.tool_calls]
                wire = {"role": "assistant", "content": blocks}
            if wire["content"]:  # Anthropic refuses an empty message (its own empty end_turn answer included)
                out.append(wire)
    body = {**params, "messages": out}
    body.setdefault("max_tokens", 1024)  # Anthropic requires it
    if thinking_enabled(body):  # thinking refuses any temperature but 1 and a top_p below 0.95
        if body.get("temperature", 1) != 1:
            del body["temperature"]
        if body.get("top_p", 1) < 0.95:
            del body["top_p"]
    if system:
        body["system"] = system
    if tools:
        body["tools"] = [{"name": f["name"], "description": f.get("description", ""),
                          "input_schema": f.get("parameters", {"type": "object"})} for f in map(tool_schema, tools)]
    return body


def _responses(protocol, system, tools, messages, params) -> dict:
    items: list[dict] = []
    for m in messages:
        if m.role == "user":
            items.append({"role": "user", "content": m.content})
        elif m.role == "tool":
            items.append({"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content})
        else:
            wire = wire_of(protocol, m)
            if wire is None:
                wire = [{"type": "function_call", "call_id": c.id, "name": c.name,
                         "arguments": json.dumps(c.arguments, ensure_ascii=False)} for c in m.tool_calls]
                if m.content:
                    wire.append({"role": "assistant", "content": m.content})
            items.extend(wire)
    if "max_tokens" in params:
        params["max_output_tokens"] = params.pop("max_tokens")
    params.pop("seed", None)  # not a Responses parameter
    body = {"store": False, "include": ["reasoning.encrypted_content"], **params, "input": items}
    if system:
        body["instructions"] = system
    if tools:  # Responses makes a function strict unless told otherwise; chat's are not (unless they say so)
        body["tools"] = [{"type": "function", "name": f["name"], "description": f.get("description", ""),
                          "parameters": f.get("parameters", {"type": "object"}), "strict": f.get("strict") is True}
                         for f in map(tool_schema, tools)]
    return body


def reply_parts(protocol: str, body: dict, reply: Reply) -> ReplyParts:
    """What the runtime records of a provider's answer (`body`, parsed as `reply`)."""
    if protocol in ("deepseek", "openai-chat"):
        message = body["choices"][0]["message"]
    elif protocol == "anthropic":
        message = {"role": "assistant", "content": body["content"]}
    else:
        message = [item for item in body["output"]]
    calls = tuple(ToolCall(c.id, c.name, _arguments(c.arguments)) for c in reply.message.calls)
    content = reply.message.content
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ReplyParts(
        reasoning=reasoning_text(reply.message), content=content or "", calls=calls,
        wire=json.dumps({"protocol": protocol, "message": message}, ensure_ascii=False),
        finish_reason="length" if reply.finish_reason in _LENGTH else "stop",
    )


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text) if text and text.strip() else {}
    except json.JSONDecodeError:
        return {"_raw": text}  # kept as text; the wire copy goes back unchanged anyway
    return value if isinstance(value, dict) else {"_value": value}
