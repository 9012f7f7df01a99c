"""A conversation's state, one layer per field group (DESIGN.md section 2):

- trace: every message as generated, reasoning included, with timings;
- history: the canonical messages the next prompt renders from;
- protocol: per-turn continuation state (tool-call ids, generated ids), opaque;
- the physical chain lives in the engine's tree, keyed by the conversation id.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import Optional

from session_runtime.accounting import StepAccounting
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.templates.base import Message, ToolCall
from session_runtime.tool_clearing import Cleared
from session_runtime.uncached import Known, totals as uncached_totals


@dataclass(frozen=True)
class TraceEntry:
    message: Message
    step: Optional[int] = None  # assistant messages: which step of the turn
    finish_reason: Optional[str] = None
    created_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        m = self.message
        out = {"turn": m.turn, "role": m.role, "content": m.content, "created_at": self.created_at}
        if m.role == "assistant":
            out.update(reasoning=m.reasoning, tool_calls=[c.as_dict() for c in m.tool_calls],
                       step=self.step, finish_reason=self.finish_reason)
        if m.role == "tool":
            out["tool_call_id"] = m.tool_call_id
        return out


@dataclass(frozen=True)
class ProtocolState:
    """What continuing the open turn requires, kept exactly as produced."""

    turn: int
    pending_calls: tuple[ToolCall, ...] = ()
    generated_ids: tuple[int, ...] = ()  # every id the turn has generated so far


@dataclass
class TurnRecord:
    """Accounting of one turn: its steps and what happened at its close."""

    index: int
    steps: list[StepAccounting] = field(default_factory=list)
    first_prompt_tokens: int = 0  # |P| of the seed: the prompt before any output
    cache_state: str = "none"
    counterfactual: Optional[dict] = None
    closed: bool = False
    fork_tokens: Optional[int] = None  # lcp of generated and canonical sequences
    materialize: Optional[str] = None  # decision and why
    materialized_prefill_tokens: int = 0
    materialized_at: Optional[float] = None  # when its canonical branch was built (epoch seconds)
    dropped_tokens: int = 0  # the generated branch past the fork that the closed history does not have
    branch_freed: bool = False  # that branch was freed at the close (else left to LRU)
    # Policy auto: what it chose for this turn's reasoning and the costs it
    # compared (AutoChoice.as_dict); written at the close, changed only to drop
    # once the chain is gone anyway (a later turn's record says so).
    auto: Optional[dict] = None

    def canonical_built(self, prefill_tokens: int) -> None:
        self.materialized_prefill_tokens = prefill_tokens
        self.materialized_at = time.time()

    def totals(self) -> dict:
        keys = ("prompt_tokens", "cached_input_tokens", "uncached_prefill_tokens",
                "recomputed_history_tokens", "output_tokens", "host_loaded_tokens", "attention_work")
        out = {k: sum(getattr(s, k) or 0 for s in self.steps) for k in keys}
        return {**out, "uncached": uncached_totals([s.uncached for s in self.steps])}

    def as_dict(self) -> dict:
        return {
            "turn": self.index, "closed": self.closed, "cache_state": self.cache_state,
            "counterfactual": self.counterfactual, "fork_tokens": self.fork_tokens,
            "materialize": self.materialize, "materialized_prefill_tokens": self.materialized_prefill_tokens,
            "materialized_at": self.materialized_at, "dropped_tokens": self.dropped_tokens,
            "branch_freed": self.branch_freed, "auto": self.auto,
            "totals": self.totals(), "steps": [dataclasses.asdict(s) for s in self.steps],
        }


_closed = operator.attrgetter("closed")
_message = operator.attrgetter("message")


@dataclass
class Conversation:
    """Mutable; only the Runtime changes it, and only after a step succeeded."""

    id: str
    system: Optional[str]
    tools: list[dict]
    tenant: Optional[str]
    template: str
    policy: ReasoningPolicy
    materialize: MaterializeSettings
    offload: "OffloadSettings" = None  # set by the Runtime
    history: list[Message] = field(default_factory=list)
    trace: list[TraceEntry] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    protocol: Optional[ProtocolState] = None  # set while a turn is open
    chain_tokens: list[int] = field(default_factory=list)  # last computed sequence
    canonical_kind: str = "none"  # what the chain holds: generated, prefix, canonical
    # Token-level shadows of what the keep and drop policies' chains would hold
    # after the last closed turn (no KV): the counterfactual reads them, so it
    # stays right after the real generated branch is freed. Not persisted: after
    # a restart no chain holds anything either.
    shadows: dict = field(default_factory=dict, compare=False)
    version: int = 0  # bumped by every committed step and every adopted history
    worker: Optional[str] = None  # many SGLang workers: the one that holds its chain
    # Inferred from a stateless client's history (inference.py): the protocol it
    # came in on; None for a conversation a client created or named.
    inferred: Optional[str] = None
    # Its tool calls' ids start with this (then _turn_step_index): an inferred
    # conversation's are random and in its protocol's form, since the client
    # echoes them back as they were handed out.
    call_prefix: str = "call"
    # What the runtime knew of its KV after the last step, for the next step's
    # `uncached` reasons (uncached.py). Not persisted: a restored conversation
    # starts from `restored_known`.
    known: Known = field(default_factory=Known, compare=False)
    # The tool uses its prompt shows cleared (tool_clearing.py): the history
    # shows them so, the trace as the client sent them.
    cleared: Cleared = field(default_factory=Cleared)
    # An inferred conversation's tail digest (inference.py) as of its last
    # write, stored with it so that other processes find it by its history.
    tail: Optional[bytes] = field(default=None, compare=False)
    # The input digest of the stateless request that ran its last step, stored
    # with it, so that a retry reaching another process finds the conversation.
    retry_key: Optional[bytes] = field(default=None, compare=False)
    # Which of the protocol's rules decided the running step's prompt (its
    # accounting's `rules`); set by Runtime.chat_step for that step only.
    rules: Optional[dict] = field(default=None, compare=False)
    # Upstream mode: its last request to the provider, by message, so that the
    # next is built past it (proxy/prefix.py). A cache: not persisted.
    outbound: Optional[object] = field(default=None, compare=False, repr=False)

    def restored_known(self) -> Known:
        """After a restart: the history its steps computed is lost with the old process's KV."""
        return Known(history_computed=any(t.steps for t in self.turns), lost="backend_lost")

    def snapshot(self) -> "Conversation":
        """What a failed step goes back to (`conv.__dict__.update(snap.__dict__)`):
        the lists a step extends and the turn record it changes are copied; the
        messages, accounting and token lists, which a step replaces and never
        changes, are shared. Pointers per message and turn: no token is copied."""
        snap = copy.copy(self)
        snap.history, snap.trace, snap.tools = list(self.history), list(self.trace), list(self.tools)
        # A step changes only the last turn's record (or appends one): earlier ones are shared.
        snap.turns = list(self.turns)
        if snap.turns:
            snap.turns[-1] = dataclasses.replace(snap.turns[-1], steps=list(snap.turns[-1].steps))
        return snap

    def trace_messages(self) -> list[Message]:
        """The trace's messages, gathered in C (a step asks for them at every length)."""
        return list(map(_message, self.trace))

    def kept_reasoning(self, closed: Optional[int] = None):
        """Which turns keep their reasoning once `closed` turns have closed
        (default: as now): the policy's rule, with auto's choices."""
        closed = self.closed_turns if closed is None else closed
        chosen = frozenset(t.index for t in self.turns if t.index < closed and t.auto is not None
                           and t.auto["choice"] == "keep") if self.policy.name == "auto" else frozenset()
        return self.policy.kept_turns(closed, chosen)

    @property
    def closed_turns(self) -> int:
        return sum(map(_closed, self.turns))  # counted in C: a step asks more than once

    @property
    def open_turn(self) -> Optional[int]:
        return self.protocol.turn if self.protocol else None
