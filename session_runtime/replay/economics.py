"""What a replayed run costs: prefill on the request path and in idle time,
decode attention, KV held over time, and FLOPs and bytes for a model shape.

Pure functions over a ReplayResult and a CostModel. What is counted, per step
with a prompt of L tokens of which q are prefilled on H = L - q reused, and n
output tokens:

- prefill attention work: q*H + q*(q+1)/2, the sum over prefilled tokens of
  their context (each attends to itself and everything before it), as
  `StepAccounting.attention_work`;
- decode attention work: the sum over the n generated tokens of their context,
  sum_{i<n} (L + i + 1) = n*L + n*(n+1)/2. Every output token is fed into the KV
  once (the replay forces them in one forward; a live engine feeds the last one
  with the next request's prefill), so prefill + output tokens is every token
  computed once;
- idle-time prefill: the canonical branch materialized after the turn closed,
  q' tokens on the fork's H' = context - q', attention q'*H' + q'*(q'+1)/2. The
  last turn's is reported apart (`after_end`): in a replay no later message can
  use it;
- FLOPs and bytes: as session_runtime/cost_model.py prices token work;
- KV held over time (token-seconds): the tokens the conversation holds, summed
  over a clock's intervals. During a step: its prompt and output; while its tool
  calls run: the chain after it; between turns: the chain the closed turn left
  (the canonical branch once materialized). The trace's own timestamps are the
  clock when every turn and step carries one (`timestamp`: seconds or ISO 8601;
  a tool step's interval minus `step_s` is its tool wait), else a nominal clock
  of `step_s` per step, `tool_s` per tool wait and `think_s` between turns. The
  clock ends when the last turn closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from session_runtime.cost_model import CostModel, Work, decode_work, prefill_work
from session_runtime.replay.clock import Clock, trace_times

if TYPE_CHECKING:
    from session_runtime.accounting import StepAccounting
    from session_runtime.replay.run import ReplayResult, TurnResult
    from session_runtime.replay.trace import Trace


# ----- work ---------------------------------------------------------------------------


def step_work(acc: "StepAccounting", chunk: int) -> Work:
    q = acc.uncached_prefill_tokens or 0
    return prefill_work(q, acc.prompt_tokens - q, chunk) + decode_work(acc.output_tokens, acc.prompt_tokens)


def materialize_work(turn: "TurnResult", chunk: int) -> Work:
    q = turn.materialized
    return prefill_work(q, turn.steps[-1].active_context_length - q, chunk)


# ----- per turn and per run -----------------------------------------------------------


@dataclass(frozen=True)
class TurnEconomics:
    turn: int  # 1-based
    request: Work  # the turn's steps
    idle: Work  # the canonical branch materialized after it closed
    after_end: bool  # the idle work follows the trace's last turn
    kv_token_seconds: float
    kv_held: int  # tokens the closed turn leaves held (its canonical branch once materialized)
    seconds: float

    def as_dict(self, cm: CostModel) -> dict:
        return {"turn": self.turn, "request": self.request.priced(cm), "idle": self.idle.priced(cm),
                "after_end": self.after_end, "kv_token_seconds": self.kv_token_seconds, "kv_held": self.kv_held,
                "seconds": self.seconds}


@dataclass(frozen=True)
class RunEconomics:
    label: str
    policy: str
    turns: tuple[TurnEconomics, ...]
    cost: CostModel = field(repr=False)

    @property
    def request(self) -> Work:
        return sum((t.request for t in self.turns), Work())

    @property
    def idle(self) -> Work:
        """Materialization that a later message could use (not after the end)."""
        return sum((t.idle for t in self.turns if not t.after_end), Work())

    @property
    def idle_end(self) -> Work:
        return sum((t.idle for t in self.turns if t.after_end), Work())

    def totals(self) -> dict:
        cm, req, idle, end = self.cost, self.request, self.idle, self.idle_end
        return {
            "request_prefill": req.prefill_tokens, "idle_prefill": idle.prefill_tokens,
            "idle_prefill_end": end.prefill_tokens, "decode_tokens": req.decode_tokens,
            "prefill_attention": req.prefill_attention, "idle_prefill_attention": idle.prefill_attention,
            "decode_attention": req.decode_attention,
            "kv_token_seconds": sum(t.kv_token_seconds for t in self.turns),
            "kv_end": self.turns[-1].kv_held if self.turns else 0,
            "seconds": sum(t.seconds for t in self.turns),
            "request_flops": req.flops(cm), "idle_flops": idle.flops(cm), "end_flops": end.flops(cm),
            "request_bytes": req.bytes(cm), "idle_bytes": idle.bytes(cm), "end_bytes": end.bytes(cm),
        }

    def as_dict(self) -> dict:
        return {"label": self.label, "policy": self.policy, "totals": self.totals(),
                "turns": [t.as_dict(self.cost) for t in self.turns]}


def _held(acc: "StepAccounting", bytes_per_token: int) -> int:
    """Tokens of the chain a step left on the device, from its KV figure (prompt
    and output when the run did not say its bytes per token)."""
    return acc.kv_device_bytes // bytes_per_token if bytes_per_token else acc.prompt_tokens + acc.output_tokens


def run_economics(result: "ReplayResult", trace: "Trace", cm: CostModel, clock: Clock = Clock()) -> RunEconomics:
    """Price every turn of `result` (a replay of `trace`) on `cm` and the clock."""
    _, times = trace_times(trace, clock)
    assert len(times) == len(result.turns), "the result must be a replay of the trace"
    bpt = result.kv_bytes_per_token
    last = len(result.turns) - 1
    out = []
    for k, (turn, tt) in enumerate(zip(result.turns, times)):
        request = sum((step_work(s, cm.prefill_chunk) for s in turn.steps), Work())
        token_s = 0.0
        for acc, step_s, wait_s in zip(turn.steps, tt.steps, tt.tool_waits):
            token_s += step_s * (acc.prompt_tokens + acc.output_tokens)  # the request's sequence while it runs
            token_s += wait_s * _held(acc, bpt)  # the chain while its tool calls run
        closed = turn.steps[-1]
        # The canonical branch once materialized; after the last turn it serves no
        # message, and is left out here as it is from the compute (`idle_end`).
        held = closed.active_context_length if turn.materialized and k != last else _held(closed, bpt)
        token_s += tt.think * held
        out.append(TurnEconomics(k + 1, request, materialize_work(turn, cm.prefill_chunk), k == last, token_s, held,
                                 sum(tt.steps) + sum(tt.tool_waits) + tt.think))
    return RunEconomics(result.spec.label, result.spec.policy, tuple(out), cm)


def ratios(run: RunEconomics | dict, base: RunEconomics | dict) -> dict[str, Optional[float]]:
    """`run` over `base` (a keep run; either a RunEconomics or its `totals()`,
    summed over traces maybe): request prefill, compute tokens (request and idle
    prefill, the end's apart), total FLOPs without and with the end's, KV
    token-seconds and KV held at the end. None where the base is 0."""
    a = run.totals() if isinstance(run, RunEconomics) else run
    b = base.totals() if isinstance(base, RunEconomics) else base

    def r(x: float, y: float) -> Optional[float]:
        return x / y if y else None

    return {
        "request_prefill": r(a["request_prefill"], b["request_prefill"]),
        "compute_tokens": r(a["request_prefill"] + a["idle_prefill"], b["request_prefill"] + b["idle_prefill"]),
        "flops": r(a["request_flops"] + a["idle_flops"], b["request_flops"] + b["idle_flops"]),
        "flops_with_end": r(a["request_flops"] + a["idle_flops"] + a["end_flops"],
                            b["request_flops"] + b["idle_flops"] + b["end_flops"]),
        "kv_token_seconds": r(a["kv_token_seconds"], b["kv_token_seconds"]),
        "kv_end": r(a["kv_end"], b["kv_end"]),
    }


# ----- the verdict ----------------------------------------------------------------------

def full_cost(totals: dict, kv_price: float) -> float:
    """A run's cost in FLOPs: the request path's and idle time's (a branch built
    after the last turn left out) plus its KV token-seconds at `kv_price` FLOPs each."""
    return totals["request_flops"] + totals["idle_flops"] + kv_price * totals["kv_token_seconds"]


def break_even(keep: dict, drop: dict) -> tuple[Optional[float], str]:
    """The KV price (FLOPs per token-second) at which keep and another run
    (`drop`) cost the same, and what it means: below it the run with fewer
    FLOPs is cheaper, above it the one that holds less. None where one is
    cheaper at every price."""
    df = drop["request_flops"] + drop["idle_flops"] - keep["request_flops"] - keep["idle_flops"]
    dk = keep["kv_token_seconds"] - drop["kv_token_seconds"]
    if dk == 0 or df == 0 or (df > 0) != (dk > 0):
        if df == 0 and dk == 0:
            return None, "keep and drop cost the same at every price"
        cheaper = "keep" if (df >= 0 and dk <= 0) else "drop"
        return None, f"{cheaper} is cheaper at every price (no fewer FLOPs and no more KV)"
    price = df / dk
    low, high = ("keep", "drop") if df > 0 else ("drop", "keep")
    return price, f"{low} is cheaper below it, {high} above it"


def verdict(rows: Sequence[tuple[str, str, dict]], kv_price: float) -> dict:
    """Each run's full cost at `kv_price`, the cheapest, and keep vs drop's
    break-even price. `rows`: (label, policy, totals) per run."""
    runs = {label: {"flops": t["request_flops"] + t["idle_flops"], "kv_token_seconds": t["kv_token_seconds"],
                    "kv_flops": kv_price * t["kv_token_seconds"], "cost_flops": full_cost(t, kv_price)}
            for label, _, t in rows}
    out: dict = {"kv_price_flops": kv_price, "runs": runs,
                 "cheapest": min(runs, key=lambda k: runs[k]["cost_flops"]) if runs else None, "break_even": {}}
    keep = next((t for _, p, t in rows if p == "keep"), None)
    for label, policy, t in rows:
        if keep is not None and policy != "keep":
            price, meaning = break_even(keep, t)
            out["break_even"][label] = {"kv_price_flops": price, "meaning": meaning.replace("drop", label)}
    return out


def compare_base(runs: Sequence[RunEconomics]) -> Optional[RunEconomics]:
    """The keep run the others are compared with, if one ran."""
    return next((r for r in runs if r.policy == "keep"), None)
