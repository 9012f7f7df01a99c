"""One state machine for every trace format: messages in, a validated Trace out.

    start --user--> asked --assistant(no calls)--> closed --user--> asked ...
                     asked --assistant(calls)--> calling --tool*n--> answered --assistant--> ...

Each reader (formats/) turns its records into these calls, each with a `Where`
that names the record for errors. A tool result goes to the pending call whose
id it names when the calls carry ids; the results without an id (or all of them,
when the calls have no ids: JSONL) take the calls no result names, in order,
the k-th such result the k-th such call. A step's results are kept in the order
of its calls, the order the runtime renders them in, whatever order they
arrived in.

Handled with a note instead of an error:
- an assistant message before the first user message (a greeting) is folded
  into the system prompt, after what the system prompt says so far, as
  GREETING + its text (its reasoning is dropped). The runtime opens every turn
  with a user message, and the greeting's tokens stay in the context every
  policy replays, so the accounting still counts them;
- a user message that ends the trace with no reply is skipped;
- a system message after the first user message is skipped (the runtime has one
  system prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.replay.trace import Trace, TraceError, TraceStep, TraceTurn

GREETING = "The assistant opened the conversation with this message:\n"


@dataclass(frozen=True)
class Where:
    """A record of the trace file: `line` is the JSONL line or the 1-based
    position of the message (step) in a JSON trace; `record` is how errors name
    it ("" for JSONL, which says "line N"); `noun` is what it is."""

    line: int
    record: str = ""
    noun: str = "line"
    timestamp: object = None  # when the record says it happened (seconds or ISO 8601), if it does

    @property
    def label(self) -> str:
        return self.record or f"line {self.line}"

    def error(self, message: str, field: str = "") -> TraceError:
        return TraceError(self.line, message, self.record, field)


@dataclass(frozen=True)
class _Result:
    where: Where
    content: str
    call_id: Optional[str]
    by_id: bool  # matched by call_id (else it takes a call no result names)
    name: Optional[str]


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict
    id: Optional[str] = None

    def forced(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


class TraceBuilder:
    """Feed messages in file order, then `finish()`. Every method raises
    TraceError naming the record when the message cannot come next."""

    def __init__(self, system: Optional[str] = None, tools: Optional[list[dict]] = None):
        self.system_parts: list[str] = [system] if system else []
        self.tools: list[dict] = list(tools or [])
        self.notes: list[str] = []
        self.turns: list[TraceTurn] = []
        self.state = "start"
        self.greetings: list[Where] = []
        self.user_at: Optional[Where] = None  # the open turn's user message
        self.user_text = ""
        self.steps: list[TraceStep] = []
        self.step_at: Optional[Where] = None  # the last step
        self.calls: tuple[Call, ...] = ()  # the last step's calls
        self.arrived: list[_Result] = []  # their results so far, in file order
        self.results: tuple[str, ...] = ()  # all of them, in call order
        self.results_at: Optional[Where] = None  # the last result

    @property
    def started(self) -> bool:
        """A user message has been seen (system text now cannot join the system prompt)."""
        return self.state != "start"

    def note(self, where: Optional[Where], text: str) -> None:
        self.notes.append(f"{where.label}: {text}" if where else text)

    # ----- one method per kind of message -----------------------------------------

    def system(self, where: Where, text: str) -> None:
        """Before the first user message: appended to the system prompt. After: skipped, noted."""
        if not self.started:
            if text.strip():
                self.system_parts.append(text)
            return
        self.note(where, "a system message after the conversation started is not replayed "
                         "(the runtime has one system prompt)")

    def user(self, where: Where, text: str) -> None:
        if not text.strip():
            raise where.error("a user message needs non-empty text")
        if self.state == "asked":
            raise where.error(f"user message after the user message of {self.user_at.label}, "
                              "which has no assistant reply")
        if self.state == "calling":
            raise where.error(f"user message while {self._unanswered()} tool call(s) "
                              f"of {self.step_at.label} are unanswered")
        if self.state == "answered":
            raise where.error(f"user message while the tool results ending at {self.results_at.label} "
                              "wait for an assistant reply")
        self._close_turn()
        self.user_at, self.user_text, self.state = where, text, "asked"

    def assistant(self, where: Where, reasoning: str, content: str, calls: Sequence[Call] = ()) -> None:
        if self.state == "start":
            return self._greeting(where, content, calls)
        if self.state == "closed":
            raise where.error(f"assistant message after the turn closed at {self.step_at.label} "
                              "(that reply made no tool calls); a user message must come first")
        if self.state == "calling":
            raise where.error(f"assistant message while {self._unanswered()} tool call(s) "
                              f"of {self.step_at.label} are unanswered")
        ids = [c.id for c in calls if c.id is not None]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise where.error(f"tool call id(s) {', '.join(map(repr, twice))} appear more than once")
        results = self.results if self.state == "answered" else ()
        self.steps.append(TraceStep(where.line, reasoning, content, tuple(c.forced() for c in calls),
                                    results, where.record, where.timestamp))
        self.step_at, self.calls = where, tuple(calls)
        self.arrived, self.results = [], ()
        self.state = "calling" if calls else "closed"

    def tool(self, where: Where, content: str, call_id: Optional[str] = None, name: Optional[str] = None,
             field: str = "") -> None:
        """A result for one of the last step's calls: the one `call_id` names when
        the calls have ids, else one no result names (see the module's docstring).
        `field` names the id's field in errors."""
        if self.state != "calling":
            why = ""
            if self.state == "answered":
                why = f": the {len(self.calls)} call(s) of {self.step_at.label} are all answered"
            raise where.error("tool result without a pending tool call" + why)
        ids = [c.id for c in self.calls]
        by_id = call_id is not None and any(i is not None for i in ids)
        if by_id:
            if call_id not in ids:
                known = ", ".join(repr(i) for i in ids if i is not None)
                raise where.error(f"tool result for id {call_id!r}, which matches no tool call of "
                                  f"{self.step_at.label} (its ids: {known})", field)
            if any(r.by_id and r.call_id == call_id for r in self.arrived):
                raise where.error(f"a second tool result for call {call_id!r} of {self.step_at.label}", field)
        self.arrived.append(_Result(where, content, call_id, by_id, name))
        self.results_at = where
        if self._unanswered() == 0:
            self.results = self._in_call_order()
            self.state = "answered"

    def _in_call_order(self) -> tuple[str, ...]:
        ids = [c.id for c in self.calls]
        slots: list[Optional[_Result]] = [None] * len(self.calls)
        for r in self.arrived:
            if r.by_id:
                slots[ids.index(r.call_id)] = r
        free = (i for i, r in enumerate(slots) if r is None)
        for r in self.arrived:
            if not r.by_id:
                slots[next(free)] = r
        for index, (r, call) in enumerate(zip(slots, self.calls)):
            if r.name is not None and r.name != call.name:
                raise r.where.error(f"tool result named {r.name!r} answers call {index + 1} of "
                                    f"{self.step_at.label}, which is {call.name!r}")
        return tuple(r.content for r in slots)

    def _greeting(self, where: Where, content: str, calls: Sequence[Call]) -> None:
        if calls:
            raise where.error("assistant message with tool calls before any user message; "
                              "a turn must open with a user message")
        self.greetings.append(where)
        if content.strip():
            self.system_parts.append(GREETING + content)
            self.note(where, "an assistant message before the first user message is folded into the "
                             "system prompt (its reasoning, if any, is dropped)")
        else:
            self.note(where, "an assistant message before the first user message, with no text, is skipped")

    def _unanswered(self) -> int:
        return len(self.calls) - len(self.arrived)

    # ----- the end ----------------------------------------------------------------

    def _close_turn(self) -> None:
        if self.user_at is not None:
            self.turns.append(TraceTurn(self.user_at.line, self.user_text, tuple(self.steps), self.user_at.record,
                                        self.user_at.timestamp))
        self.user_at, self.steps = None, []

    def finish(self, source: str, fmt: str) -> Trace:
        """The Trace, with the notes. Raises TraceError when the trace ends
        mid-step or holds no turn to replay."""
        if self.state == "calling":
            raise self.step_at.error(f"the trace ends with {self._unanswered()} unanswered tool call(s) "
                                     f"of this {self.step_at.noun}")
        if self.state == "answered":
            raise self.results_at.error("the trace ends with tool results that no assistant reply follows")
        skipped = None
        if self.state == "asked":
            skipped, self.user_at = self.user_at, None
        self._close_turn()
        if not self.turns:
            if skipped is not None:
                raise skipped.error("the trace ends after this user message, with no assistant reply, "
                                    "and holds no other turn to replay")
            if self.greetings:
                raise self.greetings[0].error("assistant message before any user message, "
                                              "and no user message follows: nothing to replay")
            raise TraceError(0, "the trace holds no messages")
        if skipped is not None:
            self.note(skipped, "the trace ends with this user message, which has no assistant reply; "
                               "it is not replayed")
        system = "\n\n".join(self.system_parts) or None
        return Trace(system, self.tools, tuple(self.turns), source, tuple(self.notes), fmt)
