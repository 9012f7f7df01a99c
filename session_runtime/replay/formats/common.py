"""Helpers the readers share: JSON loading, tool calls, text from content parts."""

from __future__ import annotations

import json
from typing import Optional

from session_runtime.replay.builder import Call, Where
from session_runtime.replay.trace import TraceError

# Content-part types that carry text: OpenAI chat ("text"), OpenAI Responses
# ("input_text", "output_text"), Anthropic and ATIF ("text").
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def load_json(text: str) -> object:
    """The whole file as one JSON value. Raises TraceError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(0, f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None


def tool_call(where: Where, field: str, call: object) -> Call:
    """A Call from {name, arguments, id?} or OpenAI's {id, type, function: {name, arguments}};
    arguments may be an object or a JSON string of one."""
    if not isinstance(call, dict):
        raise where.error(f"{field} must be an object")
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise where.error(f"{field} needs a non-empty string name")
    return Call(name, json_arguments(where, f"{field}.arguments", args), string_id(call.get("id")))


def json_arguments(where: Where, field: str, args: object) -> dict:
    """Tool-call arguments: an object, a JSON string of one, or null (none)."""
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise where.error(f"{field} is a string but not JSON") from None
    if not isinstance(args, dict):
        raise where.error(f"{field} must be an object")
    return args


def string_id(value: object) -> Optional[str]:
    return value if isinstance(value, str) and value else None


def string(where: Where, field: str, value: object) -> str:
    """An optional string field: null is ""."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise where.error(f"must be a string, got {type(value).__name__}", field)
    return value


class Dropped:
    """Content the runtime cannot replay (images, audio, redacted thinking),
    counted by kind, for one note per kind."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[int, str]] = {}  # kind -> (count, first record)

    def add(self, where: Where, kind: str) -> None:
        count, first = self.kinds.get(kind, (0, where.label))
        self.kinds[kind] = (count + 1, first)

    def notes(self) -> list[str]:
        return [f"{count} {kind} block(s) cannot be replayed and are left out (the first at {first})"
                for kind, (count, first) in self.kinds.items()]


def text_of(where: Where, field: str, content: object, dropped: Dropped, sep: str = "") -> str:
    """Text of a content field: a string, null, or a list of parts of which the
    text ones count (joined with `sep`); other parts go to `dropped`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise where.error(f"must be a string or a list of content parts, got {type(content).__name__}", field)
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise where.error("a content part must be an object with a type", f"{field}[{k}]")
        if kind in TEXT_PARTS or kind == "refusal":
            text = part.get("text" if kind != "refusal" else "refusal")
            if not isinstance(text, str):
                raise where.error("a text part's text must be a string", f"{field}[{k}]")
            texts.append(text)
        else:
            dropped.add(where, kind)
    return sep.join(texts)
