"""Our JSONL trace format (examples/TRACE_FORMAT.md): an optional first line
`{"type": "conversation", "system", "tools"}`, then one message a line. Unknown
fields are errors (a typo such as `reasonning` must not drop text silently);
errors name the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from session_runtime.replay.builder import TraceBuilder, Where
from session_runtime.replay.formats.common import tool_call
from session_runtime.replay.trace import Trace, TraceError

# Fields a recorded trace may carry that replay does not need (the runtime's own
# trace export has them, so do most loggers). `id` on a tool call and
# `tool_call_id` on a result are read: they match results to calls.
IGNORED_FIELDS = frozenset({"turn", "step", "created_at", "timestamp", "finish_reason", "id", "tool_call_id"})
ROLES = ("user", "assistant", "tool")


def parse_lines(lines: Iterable[str] | str, source: str = "<trace>") -> Trace:
    """Validate a trace given as text or lines. Raises TraceError naming the line."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    reader = _Reader()
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            reader.feed(number, raw)
    return reader.builder.finish(source, "jsonl")


def read(text: str, source: str) -> Trace:
    return parse_lines(text, source)


class _Reader:
    def __init__(self) -> None:
        self.builder = TraceBuilder()
        self.seen_message = False
        self.seen_header = False

    def feed(self, line: int, raw: str) -> None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(line, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(line, f"expected a JSON object, got {type(obj).__name__}")
        if "type" in obj and "role" not in obj:
            return self._header(line, obj)
        role = obj.get("role")
        if role not in ROLES:
            what = "no role" if role is None else f"unknown role {role!r}"
            raise TraceError(line, f"{what}; expected one of {', '.join(ROLES)} "
                                   "(or a first line {\"type\": \"conversation\", ...})")
        self.seen_message = True
        getattr(self, "_" + role)(Where(line, timestamp=obj.get("timestamp", obj.get("created_at"))), obj)

    def _header(self, line: int, obj: dict) -> None:
        if obj.get("type") != "conversation":
            raise TraceError(line, f"unknown line type {obj.get('type')!r}; only \"conversation\" is known")
        if self.seen_message or self.seen_header:
            raise TraceError(line, "the conversation line must be the first line of the trace")
        _no_extra(line, obj, {"type", "system", "tools"}, "the conversation line")
        system, tools = obj.get("system"), obj.get("tools") or []
        if system is not None and not isinstance(system, str):
            raise TraceError(line, "system must be a string")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise TraceError(line, "tools must be a list of objects (JSON schemas of functions)")
        self.builder = TraceBuilder(system or None, tools)
        self.seen_header = True

    def _user(self, where: Where, obj: dict) -> None:
        _no_extra(where.line, obj, {"role", "content"}, "a user message")
        content = obj.get("content")
        if not isinstance(content, str) or not content.strip():
            raise where.error("a user message needs a non-empty string content")
        self.builder.user(where, content)

    def _assistant(self, where: Where, obj: dict) -> None:
        _no_extra(where.line, obj, {"role", "reasoning", "reasoning_content", "content", "tool_calls"},
                  "an assistant message")
        if "reasoning" in obj and "reasoning_content" in obj:
            raise where.error("give reasoning or reasoning_content, not both")
        reasoning = obj.get("reasoning", obj.get("reasoning_content")) or ""
        content = obj.get("content") or ""
        if not isinstance(reasoning, str) or not isinstance(content, str):
            raise where.error("reasoning and content must be strings")
        raw_calls = obj.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise where.error("tool_calls must be a list")
        calls = [tool_call(where, f"tool_calls[{i}]", c) for i, c in enumerate(raw_calls)]
        self.builder.assistant(where, reasoning, content, calls)

    def _tool(self, where: Where, obj: dict) -> None:
        _no_extra(where.line, obj, {"role", "content", "name"}, "a tool result")
        content = obj.get("content", "")
        if not isinstance(content, str):
            raise where.error("a tool result's content must be a string")
        call_id = obj.get("tool_call_id")
        self.builder.tool(where, content, call_id if isinstance(call_id, str) else None, obj.get("name"),
                          "tool_call_id")


def _no_extra(line: int, obj: dict, allowed: set[str], what: str) -> None:
    extra = sorted(set(obj) - allowed - IGNORED_FIELDS)
    if extra:
        raise TraceError(line, f"unknown field(s) {', '.join(map(repr, extra))} in {what}; "
                               f"known: {', '.join(sorted(allowed))}")


def load_trace(path: str | Path) -> Trace:
    """Read and validate a JSONL trace file. Raises TraceError (or OSError)."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        return parse_trace(fh, source=str(path))


def parse_trace(lines: Iterable[str] | str, source: str = "<trace>") -> Trace:
    """Validate a JSONL trace given as text or lines. Raises TraceError naming the line."""
    return parse_lines(lines, source)
