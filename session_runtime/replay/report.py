"""Tables and the progress bar of a replay."""

from __future__ import annotations

import sys
from typing import Sequence


from session_runtime.replay.run import ReplayResult
from session_runtime.uncached import REASONS


# ----- tables -------------------------------------------------------------------------

TURN_COLUMNS = (
    ("turn", "turn"), ("line", "line"), ("steps", "steps"), ("prompt", "prompt"), ("cached", "cached"),
    ("prefill", "prefill"), ("state", "cache_state"), ("cf_keep", "cf_keep"), ("cf_drop", "cf_drop"),
    ("tool_prefill", "tool_prefill"), ("recomputed", "recomputed"), ("materialized", "materialized"),
    ("context", "context"),
)
TOTAL_COLUMNS = (
    ("label", "policy"), ("steps", "steps"), ("prompt", "prompt"), ("cached", "cached"),
    ("hit", "hit%"), ("turn_start_prefill", "turn_start"), ("tool_prefill", "tool_steps"),
    ("prefill", "prefill"), ("recomputed", "recomputed"), ("materialized", "materialized"),
    ("materialized_end", "mat_end"), ("compute", "compute"), ("context", "context"),
)
LEGEND = """\
Per turn: prompt, cached, prefill and cache_state are the turn's first step (the user message);
cf_keep / cf_drop: what that step would prefill had the whole conversation run under keep (every
turn's reasoning kept) / under drop (closed turns' reasoning dropped, the canonical branch built
when this run's materialize setting would build it), from a token-level shadow of that policy's own
chain: on every turn, what a replay under that policy really prefills (tool steps need none: under
both they prefill only the tool results); tool_prefill: the prefill of the turn's later steps
(tool results); recomputed: prefill spent on tokens before each step's new input; materialized:
idle-time prefill of the canonical branch after the turn closed (off the request path; the last
turn's is counted apart, "after end": no message of the trace can use it); context: tokens the
next turn starts from.
Totals table: prompt, cached and prefill sum every step (tool steps included); turn_start and
tool_steps split prefill; materialized excludes the last turn's (mat_end); compute = prefill +
materialized; hit% = cached / prompt."""


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 footer: Sequence[Sequence[object]] = ()) -> str:
    """Fixed-width columns: numbers right-aligned, text left-aligned; `footer`
    rows (totals) sit below a second rule."""
    every = [*rows, *footer]
    cells = [[("-" if v is None else str(v)) for v in row] for row in every]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i])
                         for i, v in enumerate(values)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(list(headers)), rule, *(line(r) for r in cells[: len(rows)])]
    if footer:
        out += [rule, *(line(r) for r in cells[len(rows):])]
    return "\n".join(out)


def turn_table(result: ReplayResult) -> str:
    """One row per turn; the footer sums each column (context: the final one),
    the last turn's materialization apart ("after end": no message can use it)."""
    rows = [t.row() for t in result.turns]
    total = {k: sum(r[k] or 0 for r in rows) for k, _ in TURN_COLUMNS if k not in ("turn", "line", "state")}
    end = rows[-1]["materialized"] if rows else 0
    total.update(turn="total", line=None, state="", context=rows[-1]["context"] if rows else 0,
                 materialized=total["materialized"] - end)
    after = {k: "" for k, _ in TURN_COLUMNS} | {"turn": "after end", "materialized": end}
    return format_table([h for _, h in TURN_COLUMNS], [[r[k] for k, _ in TURN_COLUMNS] for r in rows],
                        [[total[k] for k, _ in TURN_COLUMNS], [after[k] for k, _ in TURN_COLUMNS]])


def totals_table(results: Sequence[ReplayResult]) -> str:
    rows = []
    for r in results:
        t = {**r.totals(), "label": r.spec.label}
        t["hit"] = round(100 * t["cached"] / t["prompt"], 1) if t["prompt"] else 0.0
        rows.append([t[k] for k, _ in TOTAL_COLUMNS])
    return format_table([h for _, h in TOTAL_COLUMNS], rows)


def reasons_table(results: Sequence[ReplayResult]) -> str:
    """Why the prefilled tokens were prefilled: one row per run, one column per
    reason (uncached.py); the reasons sum to the run's prefill."""
    rows = [[r.spec.label, t["prefill"], *(t.get(f"uncached_{k}", 0) for k in REASONS)]
            for r, t in ((r, r.totals()) for r in results)]
    return format_table(["policy", "prefill", *REASONS], rows)


def describe_run(result: ReplayResult) -> str:
    s, t = result.spec, result.totals()
    head = f"== {s.label}: policy={s.policy}"
    if s.policy == "keep_last_k":
        head += f" k={s.keep_last_k}"
    if s.policy in ("drop", "keep_last_k", "auto"):
        head += f" materialize={s.materialize}"
    return "\n".join([
        head + " ==",
        turn_table(result),
        f"request-path prefill {t['prefill']} (turn starts {t['turn_start_prefill']} + tool steps {t['tool_prefill']})"
        f", idle-time materialization {t['materialized']}, compute {t['compute']}; cached {t['cached']} of "
        f"{t['prompt']} prompt tokens; {t['output']} output tokens; final context {t['context']}",
    ])


# ----- progress ------------------------------------------------------------------------


class Progress:
    """tqdm on stderr when installed, else a plain `[#####.....] n/N` bar."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.n, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.desc = ""
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="step", file=self.stream, leave=True, dynamic_ncols=True)

    def set(self, desc: str) -> None:
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc)

    def update(self) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            return
        width = 30
        done = width * self.n // max(self.total, 1)
        self.stream.write(f"\r{self.desc:<24} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self.stream.write("\n")
            self.stream.flush()
