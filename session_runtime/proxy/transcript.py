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
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.protocols.anthropic import thinking_enabled
from session_runtime.protocols.base import CHAT_PROTOCOLS  # a client's "chat" wire goes to either as it is
from session_runtime.protocols.canonical import Reply, reasoning_text
from session_runtime.proxy.prefix import OutboundPrefix
from session_runtime.sequences import first_difference
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
    Completions and Anthropic), so that only messages past it are built."""
    if protocol in CHAT_PROTOCOLS:
        return _chat(protocol, system, list(tools), messages, dict(params), prefix)
    if protocol == "anthropic":
        return _anthropic(protocol, system, list(tools), messages, dict(params), prefix)
    if protocol == "gemini":
        return _gemini(protocol, system, list(tools), list(messages), dict(params))
    return _responses(protocol, system, list(tools), list(messages), dict(params))


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


_ANTHROPIC_PIECE = WeakMemo()


def _anthropic(protocol, system, tools, messages, params, prefix: Optional[OutboundPrefix] = None) -> dict:
    """Anthropic Messages: a stored message is one wire message, a run of tool
    results one user message of tool_result blocks (`_join`), an empty
    assistant message none. Each stored message's part is built once for as
    long as it lives; with the conversation's `prefix`, only the wire messages
    from the one the first new or changed stored message falls in are joined again."""
    pieces = functools.partial(_anthropic_piece, protocol)
    if prefix is None:
        out: list = []
        _join([_ANTHROPIC_PIECE.get(m, pieces) for m in messages], 0, out, [], [])
    else:
        out = list(_joined(prefix, messages, lambda m: _ANTHROPIC_PIECE.get(m, pieces)))
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


def _anthropic_piece(protocol: str, m: Message):
    """What one stored message adds to an Anthropic body: a message, a
    tool_result block (("result", block): joined with the run it is in), or
    None (an empty assistant message: Anthropic refuses one)."""
    if m.role == "user":
        return WireMessage(role="user", content=m.content)
    if m.role == "tool":
        return ("result", {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content})
    wire = wire_of(protocol, m)
    if wire is None:  # thinking without its signature cannot go back: text and calls only
        blocks = [{"type": "text", "text": m.content}] if m.content else []
        blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in m.tool_calls]
        wire = {"role": "assistant", "content": blocks}
    return WireMessage(wire) if wire["content"] else None  # its own empty end_turn answer included


def _results(msg: dict) -> bool:
    return msg["role"] == "user" and isinstance(msg["content"], list) and all(
        b.get("type") == "tool_result" for b in msg["content"])


def _join(pieces: Sequence, start: int, out: list, owner: list, first: list) -> None:
    """Append to `out` the wire messages of `pieces[start:]`: a tool_result
    block joins the user message of results before it (a new message object:
    one already sent is never changed). `owner[i]`: the message piece i is in
    (or, for None, the one before it); `first[j]`: message j's first piece."""
    for i in range(start, len(pieces)):
        piece = pieces[i]
        if type(piece) is tuple:
            block = piece[1]
            if out and _results(out[-1]):
                out[-1] = WireMessage(role="user", content=[*out[-1]["content"], block])
            else:
                out.append(WireMessage(role="user", content=[block]))
                first.append(i)
        elif piece is not None:
            out.append(piece)
            first.append(i)
        owner.append(len(out) - 1)


def _joined(prefix: OutboundPrefix, messages: Sequence[Message], piece) -> list:
    """`_join` of the stored messages' pieces, past the last request's: from
    the wire message the first new or changed stored message falls in (a
    stored message appended at the end extends the last one, if it joins it)."""
    last, pieces, out, owner, first = prefix.joined or ([], [], [], [], [])
    k = first_difference(last, messages)
    pieces = pieces[:k] + [piece(m) for m in messages[k:]]
    if k < len(last):  # changed (or gone) from k: again from the message piece k fell in
        j = owner[k] if k < len(owner) else -1
        start = first[j] if j >= 0 else 0
        out, owner, first = out[:max(j, 0)], owner[:start], first[:max(j, 0)]
    else:
        out, owner, first, start = list(out), list(owner), list(first), k
    _join(pieces, start, out, owner, first)
    prefix.joined = (list(messages), pieces, out, owner, first)
    return out


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


# Gemini's generationConfig fields for the params every protocol is given in chat's names.
_GEMINI_CONFIG = {"max_tokens": "maxOutputTokens", "temperature": "temperature", "top_p": "topP", "seed": "seed",
                  "top_k": "topK"}


def _gemini(protocol, system, tools, messages, params) -> dict:
    """Gemini: a stored message is one turn, a run of tool results one user
    turn of functionResponse parts (each names its call, and its id where the
    call had one). A model turn from Gemini goes back as it came (its parts,
    thought parts and signatures); one built here carries Gemini's documented
    skip value on its first call, as foreign history must."""
    contents: list[dict] = []
    calls: dict[str, tuple[str, bool]] = {}  # call id -> (name, the wire call had an id)
    for m in messages:
        if m.role == "user":
            contents.append({"role": "user", "parts": [{"text": m.content}]})
        elif m.role == "tool":
            name, has_id = calls.get(m.tool_call_id, ("", True))
            response = {**({"id": m.tool_call_id} if has_id else {}), "name": name, "response": _response(m.content)}
            part = {"functionResponse": response}
            if contents and contents[-1]["role"] == "user" and all(
                    "functionResponse" in p for p in contents[-1]["parts"]):
                contents[-1] = {"role": "user", "parts": [*contents[-1]["parts"], part]}
            else:
                contents.append({"role": "user", "parts": [part]})
        else:
            wire = wire_of(protocol, m)
            if wire is None:
                parts = [{"text": m.content}] if m.content else []
                for k, c in enumerate(m.tool_calls):
                    part = {"functionCall": {"id": c.id, "name": c.name, "args": c.arguments}}
                    if k == 0:
                        part["thoughtSignature"] = "skip_thought_signature_validator"
                    parts.append(part)
                wire = {"role": "model", "parts": parts}
            wired = [p["functionCall"] for p in wire["parts"] if isinstance(p.get("functionCall"), dict)]
            for c, w in zip(m.tool_calls, wired):
                calls[c.id] = (c.name, "id" in w)
            if wire["parts"]:
                contents.append(wire)
    body: dict = {"model": params.pop("model", None)} if "model" in params else {}
    config = {_GEMINI_CONFIG[k]: params.pop(k) for k in list(params) if k in _GEMINI_CONFIG}
    body["contents"] = contents
    if system:
        body["systemInstruction"] = {"parts": [{"text": system}]}
    if tools:
        body["tools"] = [{"functionDeclarations": [
            {"name": f["name"], "description": f.get("description", ""),
             "parametersJsonSchema": f.get("parameters", {"type": "object"})} for f in map(tool_schema, tools)]}]
    body.update(params)  # the rest as given (--upstream-param), top level
    if config:
        body["generationConfig"] = {**config, **(body.get("generationConfig") or {})}
    return body


def _response(content: str) -> dict:
    """A tool result as a functionResponse's `response` (an object): the result's
    own JSON object, else `{"result": text}`."""
    try:
        value = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        return {"result": content}
    return value if isinstance(value, dict) else {"result": content}


def _gemini_calls(reply: Reply) -> tuple[ToolCall, ...]:
    """The answer's calls; one without an id (Gemini may give none) gets one
    of the runtime's, which never goes back to Gemini (`_gemini` leaves it out)."""
    return tuple(ToolCall(c.id or f"gemini_{secrets.token_hex(8)}", c.name, _arguments(c.arguments))
                 for c in reply.message.calls)


def reply_parts(protocol: str, body: dict, reply: Reply) -> ReplyParts:
    """What the runtime records of a provider's answer (`body`, parsed as `reply`)."""
    if protocol in ("deepseek", "openai-chat"):
        message = body["choices"][0]["message"]
    elif protocol == "anthropic":
        message = {"role": "assistant", "content": body["content"]}
    elif protocol == "gemini":
        message = body["candidates"][0].get("content") or {"role": "model", "parts": []}
    else:
        message = [item for item in body["output"]]
    calls = tuple(ToolCall(c.id, c.name, _arguments(c.arguments)) for c in reply.message.calls)
    if protocol == "gemini":
        calls = _gemini_calls(reply)
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
