"""The replay's clock: how long each step, tool wait and pause between turns
lasted, from a trace's own timestamps or a nominal clock.

The trace's own timestamps are the
  clock when every turn and step carries one (`timestamp`: seconds or ISO 8601;
  a tool step's interval minus `step_s` is its tool wait), else a nominal clock
  of `step_s` per step, `tool_s` per tool wait and `think_s` between turns. The
  clock ends when the last turn closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from session_runtime.replay.trace import Trace


@dataclass(frozen=True)
class Clock:
    """Seconds per interval where the trace carries no timestamps."""

    step_s: float = 2.0
    tool_s: float = 5.0
    think_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.step_s, self.tool_s, self.think_s) < 0:
            raise ValueError("clock seconds must be >= 0")


@dataclass(frozen=True)
class TurnTimes:
    steps: tuple[float, ...]  # each step's model time
    tool_waits: tuple[float, ...]  # after each tool-call step (0 after the last step)
    think: float  # after the turn closed, until the next user message (0 after the last turn)


def _seconds(value: object) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def trace_times(trace: "Trace", clock: Clock) -> tuple[str, list[TurnTimes]]:
    """("trace", times) from the trace's timestamps when every turn (its user
    message) and every step (its assistant message) has one and they never go
    back; else ("nominal", the clock's)."""
    stamps = []
    for turn in trace.turns:
        user = _seconds(getattr(turn, "timestamp", None))
        steps = [_seconds(getattr(s, "timestamp", None)) for s in turn.steps]
        stamps.append((user, steps))
    flat = [x for user, steps in stamps for x in (user, *steps)]
    if flat and None not in flat and all(b >= a for a, b in zip(flat, flat[1:])):
        times = []
        for k, (user, steps) in enumerate(stamps):
            model = [steps[0] - user]
            waits = []
            for a, b in zip(steps, steps[1:]):
                model.append(min(clock.step_s, b - a))
                waits.append(b - a - model[-1])
            nxt = stamps[k + 1][0] if k + 1 < len(stamps) else None
            times.append(TurnTimes(tuple(model), (*waits, 0.0), nxt - steps[-1] if nxt is not None else 0.0))
        return "trace", times
    last = len(trace.turns) - 1
    return "nominal", [TurnTimes(tuple(clock.step_s for _ in t.steps),
                                 (*(clock.tool_s for _ in t.steps[1:]), 0.0),
                                 clock.think_s if k < last else 0.0) for k, t in enumerate(trace.turns)]
