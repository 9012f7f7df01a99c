"""Run a parsed trace through the embedded runtime with forced output."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from session_runtime.uncached import totals as uncached_totals
from session_runtime.policies import MATERIALIZE_MODES, POLICIES

if TYPE_CHECKING:
    from session_runtime.accounting import StepAccounting
    from session_runtime.replay.clock import Clock
    from session_runtime.runtime import Runtime
    from session_runtime.templates import Message

from session_runtime.replay.trace import Trace


# ----- running it -----------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One replay: a policy, its materialization mode and a label for tables."""

    policy: str
    materialize: str = "auto"
    keep_last_k: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
        if self.materialize not in MATERIALIZE_MODES:
            raise ValueError(f"unknown materialize mode {self.materialize!r}; one of {', '.join(MATERIALIZE_MODES)}")
        if not self.label:
            object.__setattr__(self, "label", self.default_label())

    def default_label(self) -> str:
        name = f"keep_last_{self.keep_last_k}" if self.policy == "keep_last_k" else self.policy
        return f"{name}:{self.materialize}" if self.policy in ("drop", "keep_last_k", "auto") else name


def parse_run_spec(text: str, materialize: str = "auto", keep_last_k: int = 1) -> RunSpec:
    """`POLICY[:MATERIALIZE]`, e.g. `keep`, `drop:never`, `keep_last_k:always`."""
    name, _, mode = text.partition(":")
    return RunSpec(name, mode or materialize, keep_last_k)


# drop under both extremes: auto decides per turn (|R| against the tail it would prefill) and
# often skips tool-heavy turns, so `--policy drop` adds it when wanted.
COMPARE = ("keep", "drop:never", "drop:always", "keep_last_k", "auto", "engine_default", "strip_thinking_cache")


@dataclass
class TurnResult:
    index: int
    line: int
    steps: list["StepAccounting"]
    materialized: int = 0  # idle-time prefill of the canonical branch after the turn closed
    fork_tokens: Optional[int] = None
    materialize_decision: Optional[str] = None
    auto: Optional[dict] = None  # policy auto: what it chose for the turn and the costs it compared

    @property
    def first(self) -> "StepAccounting":
        return self.steps[0]

    @property
    def tool_step_prefill(self) -> int:
        return sum(s.uncached_prefill_tokens for s in self.steps[1:])

    def row(self) -> dict:
        f, cf = self.first, self.first.counterfactual or {}
        return {
            "turn": self.index + 1, "line": self.line, "steps": len(self.steps),
            "prompt": f.prompt_tokens, "cached": f.cached_input_tokens, "prefill": f.uncached_prefill_tokens,
            "state": f.cache_state,
            "cf_keep": cf.get("keep", {}).get("prefill_tokens"), "cf_drop": cf.get("drop", {}).get("prefill_tokens"),
            "tool_prefill": self.tool_step_prefill,
            "recomputed": sum(s.recomputed_history_tokens for s in self.steps),
            "materialized": self.materialized,
            "context": self.steps[-1].active_context_length,
        }

    def as_dict(self) -> dict:
        return {**self.row(), "fork_tokens": self.fork_tokens, "materialize_decision": self.materialize_decision,
                "auto": self.auto, "auto_choice": self.auto["choice"] if self.auto else None,
                "step_accounting": [s.as_dict() for s in self.steps]}


@dataclass
class ReplayResult:
    spec: RunSpec
    conversation_id: str
    tenant: str
    turns: list[TurnResult] = field(default_factory=list)
    kv_bytes_per_token: int = 0  # of the replay's model: kv_device_bytes over this is tokens held
    template: str = ""  # the conversation's chat template
    # The conversation's trace as the runtime recorded it (assistant messages with
    # their ids): what the prompt compositions are rendered from.
    messages: list["Message"] = field(default_factory=list, repr=False)

    @property
    def all_steps(self) -> list["StepAccounting"]:
        return [s for t in self.turns for s in t.steps]

    def totals(self) -> dict:
        steps = self.all_steps
        s = lambda key: sum(getattr(a, key) for a in steps)  # noqa: E731
        rows = [t.row() for t in self.turns]
        prefill = s("uncached_prefill_tokens")
        # The last turn's canonical branch serves no later message in a replay: apart.
        materialized_end = self.turns[-1].materialized if self.turns else 0
        materialized = sum(t.materialized for t in self.turns) - materialized_end
        return {
            "steps": len(steps),
            "prompt": s("prompt_tokens"),
            "cached": s("cached_input_tokens"),
            "prefill": prefill,
            "turn_start_prefill": sum(r["prefill"] for r in rows),
            "tool_prefill": sum(r["tool_prefill"] for r in rows),
            "recomputed": s("recomputed_history_tokens"),
            "materialized": materialized,
            "materialized_end": materialized_end,
            "compute": prefill + materialized,
            "output": s("output_tokens"),
            "context": self.turns[-1].steps[-1].active_context_length if self.turns else 0,
            "cf_keep": sum(r["cf_keep"] or 0 for r in rows),
            "cf_drop": sum(r["cf_drop"] or 0 for r in rows),
            "attention_work": s("attention_work"),
            **{f"uncached_{reason}": tokens
               for reason, tokens in uncached_totals([a.uncached for a in steps]).items()},
        }

    def as_dict(self) -> dict:
        return {"label": self.spec.label, "policy": self.spec.policy, "materialize": self.spec.materialize,
                "keep_last_k": self.spec.keep_last_k, "conversation_id": self.conversation_id,
                "tenant": self.tenant, "totals": self.totals(), "turns": [t.as_dict() for t in self.turns]}


class ReplayError(RuntimeError):
    """The runtime disagreed with the trace (e.g. a forced tool call did not parse back)."""


def replay(
    rt: "Runtime",
    trace: Trace,
    spec: RunSpec | str = "drop",
    *,
    tenant: Optional[str] = None,
    on_step: Optional[Callable[[], None]] = None,
    delete: bool = True,
    clock: Optional["Clock"] = None,
) -> ReplayResult:
    """Play `trace` in a new conversation of `rt` with forced output.

    Pending materializations run after each turn closes (the idle time between
    turns) and count as that turn's `materialized` tokens. `tenant` defaults to
    a fresh one, so the run shares no KV with earlier runs in the same Runtime.
    The conversation is deleted at the end unless `delete` is False (its KV stays
    in the tree, evictable). Policy auto reads the time on the trace's own
    clock (economics.trace_times: its timestamps, else `clock`'s nominal
    seconds), as the economics price it.
    """
    from session_runtime.replay.clock import Clock, trace_times

    _, times = trace_times(trace, clock or Clock())
    starts, at = [], 0.0
    for tt in times:  # each turn's user message, on the trace's clock
        starts.append(at)
        at += sum(tt.steps) + sum(tt.tool_waits) + tt.think
    if isinstance(spec, str):
        spec = parse_run_spec(spec)
    tenant = tenant or f"replay-{spec.label}-{uuid.uuid4().hex[:8]}"
    cid = rt.create_conversation(trace.system, tools=trace.tools, tenant=tenant, policy=spec.policy,
                                 keep_last_k=spec.keep_last_k, materialize=spec.materialize)
    result = ReplayResult(spec, cid, tenant, kv_bytes_per_token=rt.backend.bytes_per_token,
                          template=rt.get(cid).template)
    outlooks = rt.auto.outlooks
    wall, now = outlooks.clock, [0.0]
    outlooks.clock = lambda: now[0]
    try:
        for index, turn in enumerate(trace.turns):
            steps = []
            prev = None
            for k, ts in enumerate(turn.steps):
                now[0] = starts[index] + sum(times[index].steps[:k]) + sum(times[index].tool_waits[:k])
                if k == 0:
                    step = rt.send_message(cid, turn.user, forced=ts.forced)
                else:
                    ids = [c["id"] for c in prev.tool_calls]
                    step = rt.send_tool_results(
                        cid, [{"tool_call_id": i, "content": r} for i, r in zip(ids, ts.results)], forced=ts.forced)
                if len(step.tool_calls) != len(ts.tool_calls):
                    raise ReplayError(f"{ts.where}: {len(ts.tool_calls)} forced tool call(s) parsed back as "
                                      f"{len(step.tool_calls)} by the {rt.get(cid).template} template")
                steps.append(step.accounting)
                prev = step
                if on_step is not None:
                    on_step()
            before = rt.materializer.stats["prefill_tokens"]
            rt.materializer.run_pending()
            rt.materializer.wait_idle()
            record = rt.describe(cid)["turns"][index]
            result.turns.append(TurnResult(index, turn.line, steps, rt.materializer.stats["prefill_tokens"] - before,
                                           record["fork_tokens"], record["materialize"], record["auto"]))
        result.messages = rt.get(cid).trace_messages()
    finally:
        if delete:
            rt.delete_conversation(cid)
        outlooks.clock = wall
    return result
