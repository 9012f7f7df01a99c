"""Many traces in one replay: load every file first, replay each under every
RunSpec in one Runtime (the model loads once), then sum each policy's totals
over the traces."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

from session_runtime.replay.formats import load
from session_runtime.replay.report import describe_run, reasons_table, totals_table
from session_runtime.replay.run import ReplayError, ReplayResult, RunSpec, replay
from session_runtime.replay.trace import Trace, TraceError

if TYPE_CHECKING:
    from session_runtime.runtime import Runtime


class Loaded(NamedTuple):
    traces: list[Trace]
    errors: list[str]  # "PATH: what is wrong", one per file that failed


def load_traces(paths: Sequence[Path], fmt: str = "auto") -> Loaded:
    """Read and validate every file; a bad file does not stop the others, so
    one run reports every error. Raises ValueError for an unknown `fmt`."""
    traces, errors = [], []
    for path in paths:
        try:
            traces.append(load(path, fmt))
        except (TraceError, OSError, UnicodeDecodeError) as exc:
            errors.append(f"{path}: {exc}")
    return Loaded(traces, errors)


@dataclass
class TraceRuns:
    """One trace and its replay under each RunSpec, in order."""

    trace: Trace
    results: list[ReplayResult]


@dataclass(frozen=True)
class AggregateRun:
    """One RunSpec summed over every trace. It has the `spec` and `totals()`
    that report.totals_table reads, so the aggregate prints as a totals table."""

    spec: RunSpec
    runs: tuple[ReplayResult, ...]

    def totals(self) -> dict:
        out: dict = {}
        for r in self.runs:
            for key, value in r.totals().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = out.get(key, 0) + value
        return out

    def as_dict(self) -> dict:
        s = self.spec
        return {"label": s.label, "policy": s.policy, "materialize": s.materialize, "keep_last_k": s.keep_last_k,
                "traces": len(self.runs), "totals": self.totals()}


def replay_all(rt: "Runtime", traces: Sequence[Trace], specs: Sequence[RunSpec], *,
               on_run: Optional[Callable[[str], None]] = None,
               on_step: Optional[Callable[[], None]] = None, clock=None) -> list[TraceRuns]:
    """Replay every trace under every spec, each run in a fresh tenant (see
    `replay`, which reads the time on `clock` where the trace has none). `on_run` gets a label before each run. Raises ReplayError naming
    the trace, and the Runtime's errors."""
    out = []
    for k, trace in enumerate(traces):
        results = []
        for spec in specs:
            if on_run is not None:
                on_run(f"{k + 1}/{len(traces)} {spec.label}" if len(traces) > 1 else spec.label)
            try:
                results.append(replay(rt, trace, spec, on_step=on_step, clock=clock))
            except ReplayError as exc:
                raise ReplayError(f"{trace.source}: {exc}") from exc
        out.append(TraceRuns(trace, results))
    return out


def aggregate(runs: Sequence[TraceRuns]) -> list[AggregateRun]:
    """Each spec's results over every trace, in the specs' order."""
    if not runs:
        return []
    return [AggregateRun(r.spec, tuple(tr.results[i] for tr in runs)) for i, r in enumerate(runs[0].results)]


# ----- text --------------------------------------------------------------------------------


def trace_line(trace: Trace) -> str:
    return (f"{trace.source} ({trace.format}): {len(trace.turns)} turns, {trace.n_steps} steps, "
            f"{trace.n_tool_calls} tool calls")


def describe_trace(tr: TraceRuns, setup: str) -> str:
    """The trace's header (with `setup`: model, template, page size), its notes,
    each run's turn table, and a totals table when there are several runs."""
    lines = [f"trace {trace_line(tr.trace)}; {setup}"]
    lines += [f"  note: {n}" for n in (*tr.trace.notes, *run_notes(tr))]
    for r in tr.results:
        lines += ["", describe_run(r)]
    if len(tr.results) > 1:
        lines += ["", "== totals ==", totals_table(tr.results)]
    lines += ["", "== why each prefilled token was prefilled ==", reasons_table(tr.results)]
    return "\n".join(lines)


def run_notes(tr: TraceRuns) -> list[str]:
    """What the numbers need said beside them: a trace with no reasoning at all
    that a dropping policy still replays differently from keep."""
    if any(s.reasoning.strip() for t in tr.trace.turns for s in t.steps):
        return []
    dropping = [r for r in tr.results if r.spec.policy in ("drop", "keep_last_k", "auto")]
    keep = next((r for r in tr.results if r.spec.policy == "keep"), None)
    if not dropping or (keep is not None and all(r.totals()["prefill"] == keep.totals()["prefill"] for r in dropping)):
        return ["the trace has no reasoning: every policy replays the same prompts"]
    return ["the trace has no reasoning, yet the dropping policies prefill more than keep: the template still "
            "writes an empty think block into each message as generated and drops it from a closed turn's "
            "history, so the prompt forks there and the answer after it is prefilled again"]


def describe_aggregate(runs: Sequence[TraceRuns]) -> str:
    return "\n".join([
        f"== all {len(runs)} traces: totals per policy ==",
        totals_table(aggregate(runs)),
        "(every column is the sum over the traces; context: the sum of their final contexts; hit% of the sums)",
        "", "== why each prefilled token was prefilled ==", reasons_table(aggregate(runs)),
    ])
