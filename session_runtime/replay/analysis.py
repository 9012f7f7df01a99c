"""The replay report's economics and reasoning-share sections: flags, tables,
JSON and the prompt-composition plot (see economics.py and composition.py for
what is counted)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from session_runtime.replay.composition import RENDERINGS, Composition, ReasoningShare, reasoning_share, \
    request_compositions
from session_runtime.cost_model import KV_PRICE_ASSUMES, CostModel, cost_model, default_kv_price
from session_runtime.replay.clock import Clock, trace_times
from session_runtime.replay.economics import RunEconomics, compare_base, ratios, run_economics, verdict
from session_runtime.replay.report import format_table

if TYPE_CHECKING:
    from session_runtime.replay.run import ReplayResult
    from session_runtime.replay.trace import Trace
    from session_runtime.templates import Template


def add_arguments(parser) -> None:
    """The economics flags of `session-runtime replay`."""
    d = Clock()
    parser.add_argument("--cost-model", metavar="NAME",
                        help="model shape the FLOPs and bytes are priced for: a preset (tiny, qwen3-0.6b, qwen3-8b, "
                             "llama3-8b) or a local folder with config.json (default: --model)")
    parser.add_argument("--cost-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="element type of the priced weights and KV")
    parser.add_argument("--step-seconds", type=float, default=d.step_s,
                        help="nominal clock (traces without timestamps): seconds per model step")
    parser.add_argument("--tool-seconds", type=float, default=d.tool_s,
                        help="nominal clock: seconds a step's tool calls run before the next step")
    parser.add_argument("--think-seconds", type=float, default=d.think_s,
                        help="nominal clock: seconds between a turn's answer and the next user message")
    parser.add_argument("--plot", metavar="DIR", help="write a PNG per trace of each request's prompt composition")
    parser.add_argument("--kv-price", type=float, default=None, metavar="FLOPS",
                        help="what holding one KV token for one second costs, in FLOPs, for the verdict (default: "
                             + KV_PRICE_ASSUMES.replace("%", "%%") + ", for the cost model's KV bytes per token)")


def settings(args, prefill_chunk: int = 2048) -> tuple[CostModel, Clock]:
    """The cost model and clock the flags name. Raises ValueError."""
    if args.kv_price is not None and not args.kv_price >= 0:
        raise ValueError(f"--kv-price must be >= 0 FLOPs per KV token-second, got {args.kv_price}")
    cost = cost_model(args.cost_model or args.model, args.cost_dtype, prefill_chunk)
    return cost, Clock(args.step_seconds, args.tool_seconds, args.think_seconds)


def kv_price(args, cost: CostModel) -> tuple[float, str]:
    """The verdict's price of a KV token-second in FLOPs, and where it comes from."""
    if getattr(args, "kv_price", None) is not None:
        return args.kv_price, "--kv-price"
    return default_kv_price(cost), f"default: {KV_PRICE_ASSUMES}"


@dataclass(frozen=True)
class Analysis:
    source: str
    cost: CostModel
    clock: Clock
    clock_source: str  # "trace" (its timestamps) or "nominal"
    runs: tuple[RunEconomics, ...]
    compositions: dict[str, list[Composition]]  # keep and drop renderings
    shares: dict[str, ReasoningShare]
    kv_price: float = 0.0  # FLOPs per KV token-second, for the verdict
    kv_price_source: str = ""

    def verdict(self) -> dict:
        return verdict([(r.label, r.policy, r.totals()) for r in self.runs], self.kv_price)

    def text(self) -> str:
        c = self.clock
        clock = ("the trace's timestamps" if self.clock_source == "trace" else
                 f"nominal: {c.step_s:g} s a step, {c.tool_s:g} s a tool wait, {c.think_s:g} s between turns")
        out = [f"== economics: cost model {self.cost.name} ({self.cost.dtype}), clock {clock} =="]
        for run in self.runs:
            out += ["", f"-- {run.label} --", economics_table(run)]
        rows = [(r.label, r.totals()) for r in self.runs]
        out += ["", "-- totals --", economics_totals_table(rows)]
        base = compare_base(self.runs)
        if base is not None and len(self.runs) > 1:
            out += ["", f"-- against {base.label} --", ratios_table(rows, base.totals())]
        out += ["", verdict_text(self.verdict(), self.kv_price_source)]
        out += ["", "== reasoning share (seed 004, in tokens) ==", share_table(self.shares.values())]
        return "\n".join(out)

    def as_dict(self) -> dict:
        base = compare_base(self.runs)
        return {
            "cost_model": self.cost.describe(),
            "clock": {"source": self.clock_source, "step_seconds": self.clock.step_s,
                      "tool_seconds": self.clock.tool_s, "think_seconds": self.clock.think_s},
            "runs": [{**r.as_dict(), "against_keep": ratios(r, base) if base is not None else None}
                     for r in self.runs],
            "reasoning_share": {k: v.as_dict() for k, v in self.shares.items()},
            "verdict": {**self.verdict(), "kv_price_source": self.kv_price_source},
            "composition": {k: [c.as_dict() for c in v] for k, v in self.compositions.items()},
        }

    def plot(self, folder: str | Path) -> Path:
        from session_runtime.replay.plot import plot_composition

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{Path(self.source).stem or 'trace'}.composition.png"
        plot_composition(path, Path(self.source).name, self.compositions, self.shares)
        return path


def analyze(trace: "Trace", results: Sequence["ReplayResult"], tpl: "Template", cost: CostModel,
            clock: Clock = Clock(), price: Optional[tuple[float, str]] = None) -> Analysis:
    """Economics of every run, and the prompt composition of every request under
    keep and drop (rendered from the first run's recorded messages: forced
    output makes them the same in every run)."""
    messages = results[0].messages if results else []
    compositions = {r: request_compositions(tpl, trace.system, trace.tools, messages, r) for r in RENDERINGS}
    return Analysis(
        trace.source, cost, clock, trace_times(trace, clock)[0],
        tuple(run_economics(r, trace, cost, clock) for r in results), compositions,
        {r: reasoning_share(r, c) for r, c in compositions.items()},
        *(price or (default_kv_price(cost), f"default: {KV_PRICE_ASSUMES}")),
    )


def describe_aggregate(analyses: Sequence[Analysis]) -> str:
    """Each run's economics summed over the traces, against keep's sums, and the
    reasoning share pooled over every request of every trace (burden) and
    averaged over the traces (lastView)."""
    rows = aggregate_totals(analyses)
    out = [f"== all {len(analyses)} traces: economics per policy (sums) ==", economics_totals_table(rows)]
    base = next((t for (label, t), policy in zip(rows, _policies(analyses)) if policy == "keep"), None)
    if base is not None and len(rows) > 1:
        out += ["", "-- against keep --", ratios_table(rows, base)]
    if analyses:
        out += ["", verdict_text(aggregate_verdict(analyses), analyses[0].kv_price_source)]
    out += ["", "-- reasoning share over the traces (lastView: their mean; burden: pooled) --",
            share_table(pooled_shares(analyses))]
    return "\n".join(out)


def aggregate_verdict(analyses: Sequence[Analysis]) -> dict:
    """The verdict on each run's totals summed over the traces, and how many
    traces each run is the cheapest of."""
    rows = [(label, policy, t) for (label, t), policy in zip(aggregate_totals(analyses), _policies(analyses))]
    out = verdict(rows, analyses[0].kv_price)
    wins = [a.verdict()["cheapest"] for a in analyses]
    out["cheapest_in_traces"] = {label: wins.count(label) for label, _, _ in rows}
    return out


def verdict_text(v: dict, source: str) -> str:
    """The verdict section: each run's full cost at the stated price, the cheapest, the break-even prices."""
    price = v["kv_price_flops"]
    wins = v.get("cheapest_in_traces")
    headers = ("policy", "TFLOP", "kv_tok_s", "kv_TFLOP", "cost_TFLOP", *(("cheapest_in",) if wins else ()), "")
    lines = [f"== verdict: a KV token-second costs {price:.4g} FLOPs ({source}) =="]
    rows = []
    for label, r in v["runs"].items():
        rows.append([label, _g(r["flops"], 1e12), round(r["kv_token_seconds"]), _g(r["kv_flops"], 1e12),
                     _g(r["cost_flops"], 1e12), *((wins[label],) if wins else ()),
                     "cheapest" if label == v["cheapest"] else ""])
    lines.append(format_table(headers, rows))
    lines.append("cost = the request path's and idle time's FLOPs (a branch built after the last turn left out) "
                 "+ KV token-seconds at the price above")
    for label, be in v["break_even"].items():
        p = be["kv_price_flops"]
        lines.append(f"keep vs {label}: " + (f"break-even at {p:.4g} FLOPs per KV token-second "
                                             f"({p / price:.3g}x the price above); {be['meaning']}"
                                             if p is not None else be["meaning"]))
    return "\n".join(lines)


def _policies(analyses: Sequence[Analysis]) -> list[str]:
    return [r.policy for r in analyses[0].runs] if analyses else []


def aggregate_totals(analyses: Sequence[Analysis]) -> list[tuple[str, dict]]:
    """(label, totals summed over the traces) per run, in the runs' order;
    kv_end sums the traces' final holdings."""
    if not analyses:
        return []
    out = []
    for i, run in enumerate(analyses[0].runs):
        total: dict = {}
        for a in analyses:
            for key, value in a.runs[i].totals().items():
                total[key] = total.get(key, 0) + value
        out.append((run.label, total))
    return out


def pooled_shares(analyses: Sequence[Analysis]) -> list[ReasoningShare]:
    out = []
    for r in RENDERINGS:
        comps = [c for a in analyses for c in a.compositions[r]]
        views = [a.shares[r].last_view for a in analyses]
        out.append(ReasoningShare(r, len(comps), sum(views) / len(views) if views else 0.0,
                                  reasoning_share(r, comps).burden))
    return out


def aggregate_dict(analyses: Sequence[Analysis]) -> dict:
    rows = aggregate_totals(analyses)
    base = next((t for (label, t), policy in zip(rows, _policies(analyses)) if policy == "keep"), None)
    return {"runs": [{"label": label, "totals": t, "against_keep": ratios(t, base) if base is not None else None}
                     for label, t in rows],
            "reasoning_share": {s.rendering: s.as_dict() for s in pooled_shares(analyses)}}


# ----- tables -------------------------------------------------------------------------


def _g(x: Optional[float], scale: float = 1.0) -> Optional[float]:
    """Four significant digits, for FLOPs and bytes."""
    return None if x is None else float(f"{x / scale:.4g}")


ECONOMICS_HEADERS = ("turn", "prefill", "idle_prefill", "decode", "prefill_ctx", "decode_ctx", "kv_tok_s", "kv_held",
                     "TFLOP", "idle_TFLOP", "GB", "idle_GB")


def economics_table(run: RunEconomics) -> str:
    """Per turn: request-path prefill, idle-time prefill, decode tokens, the
    attention work of each (sums of context), KV token-seconds, KV the closed
    turn leaves, and the request path's and idle time's TFLOPs and GB. The last
    turn's idle work is its own footer row: it serves no message."""
    cm, rows = run.cost, []
    for t in run.turns:
        idle = None if t.after_end else t.idle
        rows.append([t.turn, t.request.prefill_tokens, idle.prefill_tokens if idle else None, t.request.decode_tokens,
                     t.request.prefill_attention, t.request.decode_attention,
                     round(t.kv_token_seconds), t.kv_held, _g(t.request.flops(cm), 1e12),
                     _g(idle.flops(cm), 1e12) if idle else None, _g(t.request.bytes(cm), 1e9),
                     _g(idle.bytes(cm), 1e9) if idle else None])
    tot = run.totals()
    end = run.idle_end
    footer = [
        ["total", tot["request_prefill"], tot["idle_prefill"], tot["decode_tokens"], tot["prefill_attention"],
         tot["decode_attention"], round(tot["kv_token_seconds"]), tot["kv_end"], _g(tot["request_flops"], 1e12),
         _g(tot["idle_flops"], 1e12), _g(tot["request_bytes"], 1e9), _g(tot["idle_bytes"], 1e9)],
        ["after end", "", end.prefill_tokens, "", "", "", "", "", "", _g(tot["end_flops"], 1e12),
         "", _g(tot["end_bytes"], 1e9)],
    ]
    return format_table(ECONOMICS_HEADERS, rows, footer)


def economics_totals_table(rows: Sequence[tuple[str, dict]]) -> str:
    """(label, RunEconomics.totals()) per run: one row each."""
    headers = ("policy", "prefill", "idle_prefill", "mat_end", "decode_ctx", "kv_tok_s", "kv_end", "TFLOP",
               "idle_TFLOP", "end_TFLOP", "GB", "idle_GB", "end_GB")
    out = []
    for label, t in rows:
        out.append([label, t["request_prefill"], t["idle_prefill"], t["idle_prefill_end"], t["decode_attention"],
                    round(t["kv_token_seconds"]), t["kv_end"], _g(t["request_flops"], 1e12),
                    _g(t["idle_flops"], 1e12), _g(t["end_flops"], 1e12), _g(t["request_bytes"], 1e9),
                    _g(t["idle_bytes"], 1e9), _g(t["end_bytes"], 1e9)])
    return format_table(headers, out)


def ratios_table(rows: Sequence[tuple[str, dict]], base: dict) -> str:
    """Each run's totals over the keep run's (`base`)."""
    headers = ("policy", "prefill_x", "compute_x", "flops_x", "flops_end_x", "kv_tok_s_x", "kv_end_x")
    keys = ("request_prefill", "compute_tokens", "flops", "flops_with_end", "kv_token_seconds", "kv_end")
    out = []
    for label, t in rows:
        x = ratios(t, base)
        out.append([label, *(None if x[k] is None else round(x[k], 3) for k in keys)])
    return format_table(headers, out)


def share_table(shares: Sequence[ReasoningShare] | object) -> str:
    rows = [[s.rendering, s.requests, round(s.last_view, 4), round(s.burden, 4)] for s in shares]
    return format_table(("rendering", "requests", "lastView", "burden"), rows)


ECONOMICS_LEGEND = """\
Economics (per run and turn): prefill = request-path prefill (every step); idle_prefill = the
canonical branch materialized in idle time (the last turn's is the "after end" row and mat_end:
no message of the trace can use it); decode = output tokens; prefill_ctx / decode_ctx = the
request path's attention work, the sum over computed tokens of their context length (prefill
q*H + q(q+1)/2 for q tokens on H reused, decode n*L + n(n+1)/2 for n tokens after a prompt of L);
kv_tok_s = tokens held times seconds on the clock (during a step its prompt and output, during
its tool wait its chain, between turns the closed turn's chain or its canonical branch); kv_held /
kv_end = tokens the closed turn leaves held; TFLOP = 2*N*tokens (N: non-embedding weights) +
4*layers*q_heads*head_dim*context + 2*hidden*vocab per generated token; GB = weights read per
forward (one per prefill chunk, n - 1 decodes) + KV read by attention + KV written. Against keep:
compute_x counts request and idle prefill tokens; flops_x leaves the after-end materialization
out, flops_end_x counts it.
Reasoning share: lastView = reasoning tokens / all prompt tokens of the last request; burden =
reasoning tokens summed over every request's prompt / all prompt tokens summed over every request
(each reasoning block weighted by the requests that carry it); under keep and under drop."""
