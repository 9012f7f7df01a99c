"""Adopt a message history given by a client (OpenAI-style, stateless): turn it
into a conversation's trace and canonical history, as if it had been run.

Imported assistant messages get ids from the template (`forced_ids`), so a
client that sends back what the server returned renders to the same tokens
and reuses the same KV.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import Message, Template, ToolCall


def client_messages(tpl: Template, raw: Sequence[dict], with_ids: bool = True) -> list[Message]:
    """OpenAI messages (no system) to Messages with turn numbers. Raises
    InvalidRequest. `with_ids=False`: assistant messages without the ids the
    template gives them (a comparison that reads no ids skips the rendering)."""
    out: list[Message] = []
    turn = -1
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        role = m.get("role")
        check_unicode(m, f"messages[{i}]")
        content = text_content(m.get("content"), f"messages[{i}].content")
        if role == "user":
            turn += 1
            out.append(Message("user", turn, content))
        elif role == "assistant":
            if turn < 0:
                raise InvalidRequest(f"messages[{i}]: an assistant message before any user message")
            raw_calls = m.get("tool_calls") or []
            if not isinstance(raw_calls, list) or not all(isinstance(c, dict) for c in raw_calls):
                raise InvalidRequest(f"messages[{i}].tool_calls must be a list of objects")
            calls = tuple(_tool_call(c, i) for c in raw_calls)
            reasoning = m.get("reasoning_content") or ""
            if not isinstance(reasoning, str):
                raise InvalidRequest(f"messages[{i}].reasoning_content must be a string")
            ids = tuple(tpl.forced_ids(reasoning, content, calls)) if with_ids else ()
            out.append(Message("assistant", turn, content, reasoning, calls, output_ids=ids))
        elif role == "tool":
            if not out or out[-1].role not in ("assistant", "tool"):
                raise InvalidRequest(f"messages[{i}]: a tool result must follow an assistant tool call")
            out.append(Message("tool", turn, content, tool_call_id=str(m.get("tool_call_id", ""))))
        else:
            raise InvalidRequest(f"messages[{i}].role must be user, assistant or tool (system first)")
    return out


def check_unicode(value: object, where: str) -> None:
    """Raise InvalidRequest for text that is not valid Unicode anywhere in `value`
    (a lone surrogate from a JSON escape): it could not be stored or returned."""
    import json

    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{where} is not valid Unicode: {exc.reason}") from None
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequest(f"{where} is not a JSON value") from None


def text_content(content: object, where: str = "content") -> str:
    """OpenAI content: a string, or parts of which the text ones count."""
    if content is None:
        return ""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequest(f"{where}: a text part's text must be a string")
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequest(f"{where} must be a string or a list of parts")
    return content


def message_text(m: object) -> str:
    """The text of a client message that a template renders (content, reasoning,
    tool-call names and arguments), without checking it: for the length check
    that runs before anything is tokenized."""
    if not isinstance(m, dict):
        return ""
    out = []
    for value in (m.get("content"), m.get("reasoning_content")):
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out += [p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)]
    for c in m.get("tool_calls") or () if isinstance(m.get("tool_calls"), list) else ():
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            out += [v if isinstance(v, str) else str(v) for v in (fn.get("name"), fn.get("arguments")) if v]
    return "".join(out)


def _tool_call(c: dict, i: int) -> ToolCall:
    import json

    fn = c.get("function") or {}
    if not isinstance(fn, dict):
        raise InvalidRequest(f"messages[{i}]: tool_calls[].function must be an object")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidRequest(f"messages[{i}]: tool call arguments are not JSON")
    if not isinstance(args, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"messages[{i}]: tool calls need function.name and object arguments")
    return ToolCall(id=str(c.get("id", "")), name=fn["name"], arguments=args)


def with_chat_wire(messages: Sequence[Message], raw: Sequence[dict]) -> list[Message]:
    """Upstream mode: each assistant message keeps the client's own chat message
    as its wire form (`content: null` and every field as sent), so it goes to a
    chat upstream exactly as the client wrote it. `messages` are
    `client_messages(raw)`, one per raw message."""
    import json

    assert len(messages) == len(raw), "one Message per client message"
    return [dataclasses.replace(m, wire=json.dumps({"protocol": "chat", "message": r}, ensure_ascii=False))
            if m.role == "assistant" else m for m, r in zip(messages, raw)]


def adopt(conv: Conversation, tpl: Template, messages: Sequence[Message]) -> None:
    """Replace the conversation's layers with an imported history. A trailing
    assistant message with tool calls leaves its turn open."""
    turns = sorted({m.turn for m in messages})
    last = messages[-1] if messages else None
    open_turn = last.turn if last is not None and last.role == "assistant" and last.tool_calls else None
    conv.trace = [TraceEntry(m) for m in messages]
    conv.turns = [TurnRecord(index=t, closed=t != open_turn) for t in turns]
    closed = sum(1 for t in conv.turns if t.closed)
    keep = conv.kept_reasoning(closed)
    conv.history = [tpl.strip_reasoning(m) if m.role == "assistant" and not keep(m.turn) and m.reasoning else m
                    for m in messages]
    # Each turn's first prompt, as it would have rendered then: the seed's |P|,
    # which tells the next turn whether reuse went past it (cache_state).
    for record in conv.turns:
        first_user = next(i for i, m in enumerate(messages) if m.turn == record.index and m.role == "user")
        before = [m if keep_then(record.index, m, conv, tpl) else tpl.strip_reasoning(m) for m in messages[:first_user]]
        record.first_prompt_tokens = len(
            tpl.render(conv.system, conv.tools, before + [messages[first_user]],
                       conv.kept_reasoning(record.index), True).ids)
    conv.protocol = None
    if open_turn is not None:
        generated = tuple(i for m in messages if m.turn == open_turn and m.role == "assistant" for i in m.output_ids)
        conv.protocol = ProtocolState(open_turn, last.tool_calls, generated)
    conv.chain_tokens = []
    conv.canonical_kind = "none"


def keep_then(turn: int, msg: Message, conv: Conversation, tpl: Template) -> bool:
    """Did `msg` keep its reasoning when turn `turn` opened?"""
    return msg.role != "assistant" or not msg.reasoning or conv.kept_reasoning(turn)(msg.turn)
