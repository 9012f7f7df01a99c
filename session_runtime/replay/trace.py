"""The parsed trace every reader produces, and TraceError.

The readers live in `session_runtime.replay.formats` (JSONL, ATIF, OpenAI chat,
Anthropic messages), above this module: `load_trace` / `parse_trace` (formats/jsonl.py,
exported by `session_runtime.replay`) read the JSONL format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class TraceError(ValueError):
    """A trace that cannot be replayed.

    `line` is 1-based: the JSONL line, or the position of the message (step) in
    a JSON trace; 0 is the trace as a whole. `record` names it the way the
    format does ("line 3", "messages[2]", "steps[4] (step_id 5)") and `field`
    the field at fault, when one is.
    """

    def __init__(self, line: int, message: str, record: str = "", field: str = ""):
        self.line, self.message, self.field = line, message, field
        self.record = record or (f"line {line}" if line else "")
        where = ", ".join(w for w in (self.record, field) if w)
        super().__init__(f"{where}: {message}" if where else message)


# ----- the trace ----------------------------------------------------------------


@dataclass(frozen=True)
class TraceStep:
    """One assistant message: forced output, sent with the tool results that
    answer the previous step's calls (none for a turn's first step), in the
    order of those calls."""

    line: int
    reasoning: str
    content: str
    tool_calls: tuple[dict, ...]  # {name, arguments}
    results: tuple[str, ...] = ()
    record: str = ""  # how the format names it, e.g. messages[3]; "" for JSONL (line N)
    timestamp: object = None  # the record's own time (seconds or ISO 8601): the economics' clock

    @property
    def where(self) -> str:
        return self.record or f"line {self.line}"

    @property
    def forced(self) -> dict:
        return {"reasoning": self.reasoning, "content": self.content,
                "tool_calls": [dict(c) for c in self.tool_calls]}


@dataclass(frozen=True)
class TraceTurn:
    line: int  # the user message
    user: str
    steps: tuple[TraceStep, ...]
    record: str = ""
    timestamp: object = None

    @property
    def where(self) -> str:
        return self.record or f"line {self.line}"


@dataclass(frozen=True)
class Trace:
    system: Optional[str]
    tools: list[dict]
    turns: tuple[TraceTurn, ...]
    source: str = "<trace>"
    # What the reader changed or left out so the trace could be replayed (a greeting
    # folded into the system prompt, a trailing user message skipped); the report prints them.
    notes: tuple[str, ...] = ()
    format: str = "jsonl"

    @property
    def n_steps(self) -> int:
        return sum(len(t.steps) for t in self.turns)

    @property
    def n_tool_calls(self) -> int:
        return sum(len(s.tool_calls) for t in self.turns for s in t.steps)
