"""Parse and validate a recorded agent trace (JSONL); errors name the line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional


# Fields a recorded trace may carry that replay does not need (the runtime's own
# trace export has them, so do most loggers).
IGNORED_FIELDS = frozenset({"turn", "step", "created_at", "timestamp", "finish_reason", "id", "tool_call_id"})
ROLES = ("user", "assistant", "tool")


class TraceError(ValueError):
    """A trace that cannot be replayed; `line` is 1-based (0: the trace as a whole)."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


# ----- the trace ----------------------------------------------------------------


@dataclass(frozen=True)
class TraceStep:
    """One assistant message: forced output, sent with the tool results that
    answer the previous step's calls (none for a turn's first step)."""

    line: int
    reasoning: str
    content: str
    tool_calls: tuple[dict, ...]  # {name, arguments}
    results: tuple[str, ...] = ()

    @property
    def forced(self) -> dict:
        return {"reasoning": self.reasoning, "content": self.content,
                "tool_calls": [dict(c) for c in self.tool_calls]}


@dataclass(frozen=True)
class TraceTurn:
    line: int  # the user message
    user: str
    steps: tuple[TraceStep, ...]


@dataclass(frozen=True)
class Trace:
    system: Optional[str]
    tools: list[dict]
    turns: tuple[TraceTurn, ...]
    source: str = "<trace>"

    @property
    def n_steps(self) -> int:
        return sum(len(t.steps) for t in self.turns)

    @property
    def n_tool_calls(self) -> int:
        return sum(len(s.tool_calls) for t in self.turns for s in t.steps)


def load_trace(path: str | Path) -> Trace:
    """Read and validate a JSONL trace file. Raises TraceError (or OSError)."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        return parse_trace(fh, source=str(path))


def parse_trace(lines: Iterable[str] | str, source: str = "<trace>") -> Trace:
    """Validate a trace given as text or lines. Raises TraceError naming the line."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    parser = _Parser()
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            parser.feed(number, raw)
    return parser.finish(source)


class _Parser:
    """A state machine over messages:

    start --user--> asked --assistant(no calls)--> closed --user--> asked ...
                     asked --assistant(calls)--> calling --tool*n--> answered --assistant--> ...
    """

    def __init__(self) -> None:
        self.system: Optional[str] = None
        self.tools: list[dict] = []
        self.turns: list[TraceTurn] = []
        self.state = "start"
        self.seen_message = False
        self.user: Optional[tuple[int, str]] = None  # line and text of the open turn's user message
        self.steps: list[TraceStep] = []
        self.calls: tuple[dict, ...] = ()  # the last step's calls
        self.calls_line = 0
        self.results: list[str] = []
        self.results_line = 0

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
        getattr(self, "_" + role)(line, obj)

    # ----- one handler per kind of line ------------------------------------------

    def _header(self, line: int, obj: dict) -> None:
        if obj.get("type") != "conversation":
            raise TraceError(line, f"unknown line type {obj.get('type')!r}; only \"conversation\" is known")
        if self.seen_message or self.state != "start":
            raise TraceError(line, "the conversation line must be the first line of the trace")
        _no_extra(line, obj, {"type", "system", "tools"}, "the conversation line")
        system, tools = obj.get("system"), obj.get("tools") or []
        if system is not None and not isinstance(system, str):
            raise TraceError(line, "system must be a string")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise TraceError(line, "tools must be a list of objects (JSON schemas of functions)")
        self.system, self.tools = system or None, tools
        self.state = "header"

    def _user(self, line: int, obj: dict) -> None:
        _no_extra(line, obj, {"role", "content"}, "a user message")
        content = obj.get("content")
        if not isinstance(content, str) or not content.strip():
            raise TraceError(line, "a user message needs a non-empty string content")
        if self.state == "asked":
            raise TraceError(line, f"user message after the user message of line {self.user[0]}, "
                                   "which has no assistant reply")
        if self.state == "calling":
            raise TraceError(line, f"user message while {len(self.calls) - len(self.results)} tool call(s) "
                                   f"of line {self.calls_line} are unanswered")
        if self.state == "answered":
            raise TraceError(line, f"user message while the tool results ending at line {self.results_line} "
                                   "wait for an assistant reply")
        self._close_turn()
        self.user = (line, content)
        self.state = "asked"

    def _assistant(self, line: int, obj: dict) -> None:
        _no_extra(line, obj, {"role", "reasoning", "reasoning_content", "content", "tool_calls"},
                  "an assistant message")
        if self.state in ("start", "header"):
            raise TraceError(line, "assistant message before any user message")
        if self.state == "closed":
            raise TraceError(line, f"assistant message after the turn closed at line {self.steps[-1].line} "
                                   "(that reply made no tool calls); a user message must come first")
        if self.state == "calling":
            raise TraceError(line, f"assistant message while {len(self.calls) - len(self.results)} tool call(s) "
                                   f"of line {self.calls_line} are unanswered")
        if "reasoning" in obj and "reasoning_content" in obj:
            raise TraceError(line, "give reasoning or reasoning_content, not both")
        reasoning = obj.get("reasoning", obj.get("reasoning_content")) or ""
        content = obj.get("content") or ""
        if not isinstance(reasoning, str) or not isinstance(content, str):
            raise TraceError(line, "reasoning and content must be strings")
        raw_calls = obj.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise TraceError(line, "tool_calls must be a list")
        calls = tuple(_tool_call(line, i, c) for i, c in enumerate(raw_calls))
        results = tuple(self.results) if self.state == "answered" else ()
        self.steps.append(TraceStep(line, reasoning, content, calls, results))
        self.results = []
        if calls:
            self.calls, self.calls_line, self.state = calls, line, "calling"
        else:
            self.calls, self.state = (), "closed"

    def _tool(self, line: int, obj: dict) -> None:
        _no_extra(line, obj, {"role", "content", "name"}, "a tool result")
        if self.state != "calling":
            why = ""
            if self.state == "answered":
                why = f": the {len(self.calls)} call(s) of line {self.calls_line} are all answered"
            raise TraceError(line, "tool result without a pending tool call" + why)
        content = obj.get("content", "")
        if not isinstance(content, str):
            raise TraceError(line, "a tool result's content must be a string")
        call = self.calls[len(self.results)]
        name = obj.get("name")
        if name is not None and name != call["name"]:
            raise TraceError(line, f"tool result named {name!r} answers call {len(self.results) + 1} of line "
                                   f"{self.calls_line}, which is {call['name']!r}")
        self.results.append(content)
        self.results_line = line
        if len(self.results) == len(self.calls):
            self.state = "answered"

    # ----- the end ----------------------------------------------------------------

    def _close_turn(self) -> None:
        if self.user is not None:
            self.turns.append(TraceTurn(self.user[0], self.user[1], tuple(self.steps)))
        self.user, self.steps = None, []

    def finish(self, source: str) -> Trace:
        if self.state == "asked":
            raise TraceError(self.user[0], "the trace ends after this user message, with no assistant reply")
        if self.state == "calling":
            raise TraceError(self.calls_line, f"the trace ends with {len(self.calls) - len(self.results)} "
                                              "unanswered tool call(s) of this line")
        if self.state == "answered":
            raise TraceError(self.results_line, "the trace ends with tool results that no assistant reply follows")
        self._close_turn()
        if not self.turns:
            raise TraceError(0, "the trace holds no messages")
        return Trace(self.system, self.tools, tuple(self.turns), source)


def _no_extra(line: int, obj: dict, allowed: set[str], what: str) -> None:
    extra = sorted(set(obj) - allowed - IGNORED_FIELDS)
    if extra:
        raise TraceError(line, f"unknown field(s) {', '.join(map(repr, extra))} in {what}; "
                               f"known: {', '.join(sorted(allowed))}")


def _tool_call(line: int, index: int, call: object) -> dict:
    """{name, arguments} from {name, arguments} or OpenAI's {type, function: {...}}."""
    where = f"tool_calls[{index}]"
    if not isinstance(call, dict):
        raise TraceError(line, f"{where} must be an object")
    fn = call.get("function", call) if isinstance(call.get("function"), dict) else call
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise TraceError(line, f"{where} needs a non-empty string name")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise TraceError(line, f"{where}.arguments is a string but not JSON") from None
    if not isinstance(args, dict):
        raise TraceError(line, f"{where}.arguments must be an object")
    return {"name": name, "arguments": args}
