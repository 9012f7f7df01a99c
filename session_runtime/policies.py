"""Reasoning policies and the canonical-branch materialization decision."""

from __future__ import annotations

from dataclasses import dataclass

from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import KeepFrom, KeepReasoning, keep_chosen

POLICIES = ("keep", "drop", "keep_last_k", "auto", "engine_default", "strip_thinking_cache")
MATERIALIZE_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class ReasoningPolicy:
    """What the next prompt keeps of closed turns' reasoning, and how KV is held.

    - keep: every turn's reasoning is replayed; the chain is the generated sequence.
    - drop: closed turns lose their reasoning; the open tool chain keeps it.
    - keep_last_k: only the last k closed turns keep their reasoning.
    - auto: each turn's close keeps or drops its reasoning by what each costs
      over the conversation's expected rest (auto_policy.py); the choice is
      written on the turn and never flips, unless the chain is gone anyway.
    - engine_default (baseline, today's SGLang): the template drops reasoning, no
      conversation holds a lock, the generated branch is left to LRU.
    - strip_thinking_cache (baseline, SGLang's flag): as engine_default, and a
      step's output is never cached, tool-chain steps included.
    """

    name: str = "drop"
    keep_last_k: int = 1

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise InvalidRequest(f"policy must be one of {', '.join(POLICIES)}; got {self.name!r}")
        if self.keep_last_k < 0:
            raise InvalidRequest(f"keep_last_k must be >= 0, got {self.keep_last_k}")

    def kept_turns(self, closed_turns: int, chosen: frozenset = frozenset()) -> KeepReasoning:
        """Which turns keep reasoning once `closed_turns` turns have closed. The
        open turn (index closed_turns) always keeps it: the tool chain continues
        exactly. `chosen`: under auto, the closed turns it chose to keep."""
        if self.name == "auto":
            return keep_chosen(chosen, closed_turns)
        if self.name == "keep":
            return KeepFrom(float("-inf"))
        if self.name == "keep_last_k":
            return KeepFrom(closed_turns - self.keep_last_k)
        return KeepFrom(closed_turns)

    @property
    def holds_chain(self) -> bool:
        """Does the conversation lock its chain between steps?"""
        return self.name not in ("engine_default", "strip_thinking_cache")

    @property
    def caches_output(self) -> bool:
        return self.name != "strip_thinking_cache"

    @property
    def may_materialize(self) -> bool:
        return self.name in ("drop", "keep_last_k", "auto")


@dataclass(frozen=True)
class MaterializeSettings:
    """When to prefill the canonical branch in idle time after a turn closes.

    `auto` materializes when the conversation is likely to continue, the
    dropped reasoning is long against the answer (the fork saves |R| of
    context for |A| of prefill), the engine is idle and the pool has room.
    """

    mode: str = "auto"
    continue_probability: float = 0.8  # expected chance of another user turn
    min_continue_probability: float = 0.5
    # |R| over everything re-prefilled after the fork (answer, tool calls and
    # results): below this the shorter context is not worth a second prefill.
    min_reasoning_ratio: float = 0.25
    min_free_fraction: float = 0.10  # free share of the device pool
    require_idle: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MATERIALIZE_MODES:
            raise InvalidRequest(f"materialize must be one of {', '.join(MATERIALIZE_MODES)}; got {self.mode!r}")
        if not 0.0 <= self.continue_probability <= 1.0:
            raise InvalidRequest("continue_probability must be within [0, 1]")

    def decide(self, reasoning_tokens: int, answer_tokens: int, free_fraction, idle: bool) -> tuple[bool, str]:
        """(materialize?, why) for one closed turn. `free_fraction` is a float or
        a callable giving one, read only when the decision needs it (on SGLang
        it is a round trip to the scheduler)."""
        if self.mode != "auto":
            return self.mode == "always", f"materialize={self.mode}"
        if self.continue_probability < self.min_continue_probability:
            return False, "conversation unlikely to continue"
        if reasoning_tokens < self.min_reasoning_ratio * max(answer_tokens, 1):
            return False, f"|R|/|A| = {reasoning_tokens}/{answer_tokens} below {self.min_reasoning_ratio}"
        if callable(free_fraction):
            free_fraction = free_fraction()
        if free_fraction < self.min_free_fraction:
            return False, f"pool {free_fraction:.0%} free, below {self.min_free_fraction:.0%}"
        if self.require_idle and not idle:
            return False, "engine busy"
        return True, "auto"
