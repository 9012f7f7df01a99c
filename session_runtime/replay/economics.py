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
- FLOPs: 2 * N * tokens for the linear layers (N: the non-embedding weights:
  q, k, v, o projections and the gated MLP of every layer; norms left out), plus
  4 * layers * q_heads * head_dim * context for attention (QK^T and AV, per
  token), plus 2 * hidden * vocab for each logits row (one per generated token;
  materialization computes none);
- bytes: weights read once per forward (N, plus the LM head when it computes
  logits), at `dtype`; a step's forwards are ceil(q / prefill_chunk) prefill
  chunks and n - 1 decodes (its first token comes from the prefill's logits);
  KV read: each decode token reads its context, each prefill chunk reads the KV
  of everything up to its end once; KV written: every computed token once. KV
  bytes per token: 2 * layers * kv_heads * head_dim * element size;
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

import math
from dataclasses import asdict, astuple, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from session_runtime.accounting import StepAccounting
    from session_runtime.config import ModelConfig
    from session_runtime.replay.run import ReplayResult, TurnResult
    from session_runtime.replay.trace import Trace

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----- the model shape ----------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """A model shape priced per token; `dtype` sets weight and KV element size."""

    name: str
    shape: "ModelConfig"
    dtype: str = "bfloat16"
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"cost dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def non_embedding_params(self) -> int:
        s = self.shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return s.num_layers * (s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.shape.hidden_size * self.shape.vocab_size

    @property
    def attention_flops_per_context(self) -> int:
        return 4 * self.shape.num_layers * self.shape.num_heads * self.shape.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.element_bytes

    def describe(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "prefill_chunk": self.prefill_chunk,
                "non_embedding_params": self.non_embedding_params, "lm_head_params": self.lm_head_params,
                "kv_bytes_per_token": self.kv_bytes_per_token, **asdict(self.shape)}


def cost_model(name: str, dtype: str = "bfloat16", prefill_chunk: int = 2048) -> CostModel:
    """A preset of config.PRESETS, or a local Hugging Face folder's config.json.
    Raises ValueError."""
    from session_runtime.config import PRESETS

    if name in PRESETS:
        return CostModel(name, PRESETS[name], dtype, prefill_chunk)
    folder = Path(name)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--cost-model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a local folder "
                         "with config.json")
    from session_runtime.errors import InvalidRequest
    from session_runtime.model.weights import config_from_hf

    try:
        shape = config_from_hf(folder)
    except (InvalidRequest, KeyError, ValueError) as exc:
        raise ValueError(f"--cost-model {name!r}: {exc}") from None
    return CostModel(folder.name, shape, dtype, prefill_chunk)


# ----- work ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """Token work of some steps or materializations, before pricing."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_attention: int = 0  # sum of context over prefilled tokens
    decode_attention: int = 0  # sum of context over generated tokens
    forwards: int = 0  # weight reads
    logits_rows: int = 0
    kv_read_tokens: int = 0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def flops(self, cm: CostModel) -> int:
        tokens = self.prefill_tokens + self.decode_tokens
        return (2 * cm.non_embedding_params * tokens
                + cm.attention_flops_per_context * (self.prefill_attention + self.decode_attention)
                + 2 * cm.lm_head_params * self.logits_rows)

    def bytes(self, cm: CostModel) -> int:
        """Weights read (N per forward, the LM head once per logits row: the
        prefill's last chunk and each decode forward) plus KV read and written."""
        weights = self.forwards * cm.non_embedding_params + self.logits_rows * cm.lm_head_params
        written = self.prefill_tokens + self.decode_tokens
        return weights * cm.element_bytes + (self.kv_read_tokens + written) * cm.kv_bytes_per_token

    def priced(self, cm: CostModel) -> dict:
        return {**asdict(self), "flops": self.flops(cm), "bytes": self.bytes(cm)}


def prefill_work(q: int, reused: int, chunk: int) -> Work:
    """q tokens prefilled on `reused` ones, in chunks of `chunk` (no logits)."""
    if q <= 0:
        return Work()
    chunks = math.ceil(q / chunk)
    read = sum(reused + min(q, (c + 1) * chunk) for c in range(chunks))
    return Work(prefill_tokens=q, prefill_attention=q * reused + q * (q + 1) // 2, forwards=chunks,
                kv_read_tokens=read)


def decode_work(n: int, context: int) -> Work:
    """n generated tokens after a prompt of `context` tokens: n - 1 decode
    forwards, n logits rows, the i-th token attending to context + i + 1."""
    if n <= 0:
        return Work()
    attention = n * context + n * (n + 1) // 2
    return Work(decode_tokens=n, decode_attention=attention, forwards=n - 1, logits_rows=n, kv_read_tokens=attention)


def step_work(acc: "StepAccounting", chunk: int) -> Work:
    q = acc.uncached_prefill_tokens or 0
    return prefill_work(q, acc.prompt_tokens - q, chunk) + decode_work(acc.output_tokens, acc.prompt_tokens)


def materialize_work(turn: "TurnResult", chunk: int) -> Work:
    q = turn.materialized
    return prefill_work(q, turn.steps[-1].active_context_length - q, chunk)


# ----- the clock ----------------------------------------------------------------------


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

# What the default price of a KV token-second assumes: one GPU-second of compute
# is worth as much as holding the GPU's whole memory for that second. An H100
# SXM: 989 TFLOP/s dense bf16 peak, run at 40% of it; 80 GB of HBM.
GPU_FLOPS_PER_S = 0.4 * 989e12
GPU_MEMORY_BYTES = 80e9
KV_PRICE_ASSUMES = ("one H100-second of compute (40% of 989 TFLOP/s bf16) costs as much as holding its "
                    "80 GB of HBM for a second")


def default_kv_price(cm: CostModel) -> float:
    """FLOPs one KV token-second is worth, by KV_PRICE_ASSUMES, for `cm`'s KV bytes per token."""
    return GPU_FLOPS_PER_S * cm.kv_bytes_per_token / GPU_MEMORY_BYTES


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
