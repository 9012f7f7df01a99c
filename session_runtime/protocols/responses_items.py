"""Responses input and output items as canonical messages, and back.

User, system and developer message items are one message each;
`function_call_output` (and any other `*_output` item) is a tool message. Every
run of consecutive model items (reasoning, function_call, assistant message,
any other item type) is one assistant message: each reasoning item is a
`Reasoning` with the item verbatim in `opaque` (id, summary,
encrypted_content, status), each function_call a `Call` (id = call_id, the
item in `opaque`), the assistant messages' content parts are concatenated in
`content`, and their wrappers (id, status) and any other items are kept in
`extra["items"]`. `layout` records the run's item order: "reasoning", "call",
"item", and "message:N" for a message item of N parts ("message:str" for one
whose content is a string).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from session_runtime.protocols.base import ProtocolInputError, arrange, clone, expect_list, expect_object, expect_str
from session_runtime.protocols.canonical import Call, Msg, Reasoning

STRING_INPUT = "input:string"  # the layout of the one user message of `input: "text"`


def item_kind(item: dict, path: str) -> str:
    """message (user, system, developer), tool (a call's output) or run (the model's items)."""
    kind, role = item.get("type"), item.get("role")
    if kind in (None, "message") and role in ("user", "system", "developer"):
        return "message"
    if kind in (None, "message") and role != "assistant":
        raise ProtocolInputError(f"{path}.role", f"unknown role {role!r}; expected user, system, developer or assistant")
    if isinstance(kind, str) and kind.endswith("_output"):
        return "tool"
    return "run"


def reasoning_item_text(item: dict) -> str:
    """A reasoning item's readable text: its reasoning_text parts, else its summary."""
    for key in ("content", "summary"):
        texts = [p.get("text") for p in item.get(key) or () if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return "\n\n".join(texts)
    return ""


def parse_items(items: list, path: str) -> tuple[Msg, ...]:
    """Input (or output) items as messages: one per user, system, developer or
    tool item, one per run of the model's items. Raises ProtocolInputError."""
    out: list[Msg] = []
    run: list[tuple[int, dict]] = []
    for i, item in enumerate(items):
        expect_object(item, f"{path}[{i}]")
        kind = item_kind(item, f"{path}[{i}]")
        if kind == "run":
            if run and _splits(run, item):
                out.append(parse_run(run, path))
                run = []
            run.append((i, item))
            continue
        if run:
            out.append(parse_run(run, path))
            run = []
        out.append(parse_single(item, f"{path}[{i}]", kind))
    if run:
        out.append(parse_run(run, path))
    return tuple(out)


def render_items(msg: Msg) -> list[dict]:
    """A message's input items."""
    if msg.role == "tool":
        values = {} if msg.layout else {"type": "function_call_output"}
        values.update({"call_id": msg.call_id, "output": clone(msg.content), **clone(msg.extra)})
        return [arrange(values, msg.layout)]
    if msg.role != "assistant":
        values = {"role": msg.role}
        if not msg.layout or "content" in msg.layout or msg.content is not None:
            values["content"] = clone(msg.content)
        return [arrange({**values, **clone(msg.extra)}, msg.layout)]
    return render_run(msg)


def _splits(run: list[tuple[int, dict]], item: dict) -> bool:
    """A message item with string content shares its turn with no other message item."""
    def message(it: dict) -> bool:
        return it.get("role") == "assistant"
    return message(item) and any(message(it) and (isinstance(it.get("content"), str) or isinstance(
        item.get("content"), str)) for _, it in run)


def parse_single(item: dict, path: str, kind: str) -> Msg:
    if kind == "tool":
        call_id = item.get("call_id")
        if call_id is not None or item.get("type") == "function_call_output":
            expect_str(call_id, f"{path}.call_id")
        extra = {k: clone(v) for k, v in item.items() if k not in ("call_id", "output")}
        return Msg("tool", clone(item.get("output")), call_id=call_id, extra=extra, layout=tuple(item))
    content = item.get("content")
    if not isinstance(content, (str, list)):
        raise ProtocolInputError(f"{path}.content", "expected a string or an array of content parts")
    extra = {k: clone(v) for k, v in item.items() if k not in ("role", "content")}
    return Msg(item["role"], clone(content), extra=extra, layout=tuple(item))


def parse_run(run: list[tuple[int, dict]], path: str) -> Msg:
    reasoning: list[Reasoning] = []
    calls: list[Call] = []
    parts: list = []
    text: Optional[str] = None
    kept: list[dict] = []
    layout: list[str] = []
    for i, item in run:
        where, kind = f"{path}[{i}]", item.get("type")
        if kind == "reasoning":
            reasoning.append(Reasoning(reasoning_item_text(item), clone(item)))
            layout.append("reasoning")
        elif kind == "function_call":
            calls.append(Call(expect_str(item.get("call_id"), f"{where}.call_id"),
                              expect_str(item.get("name"), f"{where}.name"),
                              expect_str(item.get("arguments"), f"{where}.arguments"), clone(item)))
            layout.append("call")
        elif item.get("role") == "assistant":
            content = item.get("content")
            if isinstance(content, str):
                text = content
                layout.append("message:str")
            else:
                parts += clone(expect_list(content, f"{where}.content"))
                layout.append(f"message:{len(content)}")
            kept.append({**clone(item), "content": None})  # a placeholder keeps the key's place
        else:
            expect_str(kind, f"{where}.type")
            kept.append(clone(item))
            layout.append("item")
    content = text if text is not None else parts if any(s.startswith("message:") for s in layout) else None
    return Msg("assistant", content, tuple(reasoning) if reasoning else None, tuple(calls),
               extra={"items": kept} if kept else {}, layout=tuple(layout))


def render_run(msg: Msg) -> list[dict]:
    """A turn's items in its layout (hand-built: reasoning, message, calls)."""
    reasoning = [clone(r.opaque) if r.opaque is not None else
                 {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": r.text}]}
                 for r in msg.reasoning or ()]
    calls = [render_call(c) for c in msg.calls]
    kept = [clone(item) for item in msg.extra.get("items", ())]
    out: list[dict] = []
    used, consumed = 0, False
    for slot in msg.layout:
        if slot == "reasoning" and reasoning:
            out.append(reasoning.pop(0))
        elif slot == "call" and calls:
            out.append(calls.pop(0))
        elif slot == "item":
            out.append(kept.pop(0))
        elif slot.startswith("message:"):
            wrapper, consumed = kept.pop(0), True
            n = slot[len("message:"):]
            wrapper["content"] = clone(msg.content) if n == "str" else clone(msg.content[used:used + int(n)])
            used += 0 if n == "str" else int(n)
            out.append(wrapper)
    message = [] if consumed or msg.content in (None, "", []) else [
        {"type": "message", "role": "assistant", "content": clone(msg.content)}]
    return out + reasoning + message + calls


def render_call(c: Call) -> dict:
    if c.opaque is None:
        return {"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments}
    return {**clone(c.opaque), "call_id": c.id, "name": c.name, "arguments": c.arguments}


def without_reasoning(msg: Msg) -> Msg:
    """The turn without its reasoning items, and without the ids that tie its
    other items to them."""
    calls = tuple(dataclasses.replace(c, opaque={k: v for k, v in c.opaque.items() if k != "id"})
                  if c.opaque is not None and "id" in c.opaque else c for c in msg.calls)
    messages = iter(s.startswith("message:") for s in msg.layout if s == "item" or s.startswith("message:"))
    items = [{k: v for k, v in item.items() if k != "id"} if next(messages) else item
             for item in msg.extra.get("items", ())]
    extra = {**msg.extra, "items": items} if "items" in msg.extra else msg.extra
    return dataclasses.replace(msg, reasoning=None, calls=calls, extra=extra)
