"""A turn's close (turn_close.py is the runtime's part for it): apply the
reasoning policy to the closed turn, find the fork, hold the chain there and
free or keep the generated branch (one backend call), maybe schedule the
canonical branch, and set the shadows of keep and drop for the next turn's
counterfactual. Policy auto decides here, at the close, and again at a turn's
first step when the chain it kept is gone (`redrop`).

It is handed what it uses when built (the backend, the materializer, the auto
policy, the idle TTL) and changes only the conversation it is given, whose
lock its caller (step_path.py) holds."""

from __future__ import annotations

import dataclasses
import operator
from itertools import compress
from typing import Optional

from session_runtime import turns as turn_rules
from session_runtime.auto_policy import AutoChoice, AutoPolicy, TurnShape
from session_runtime.backends.base import Backend, ChainState
from session_runtime.conversation import Conversation, TurnRecord
from session_runtime.errors import BackendUnavailable
from session_runtime.materializer import Materializer
from session_runtime.policies import MaterializeSettings
from session_runtime.templates import Message, Template
from session_runtime.templates.base import keeping_starts


class TurnClose:
    def __init__(self, backend: Backend, materializer: Materializer, auto: AutoPolicy, idle_ttl_s: float):
        self.backend = backend
        self.materializer = materializer
        self.auto = auto
        self.idle_ttl_s = idle_ttl_s

    def close(self, conv, tpl, ns, record: TurnRecord, generated: list[int], acc,
              chain: Optional[ChainState]):
        """Apply the reasoning policy to the closed turn: rebuild the canonical
        history, find the fork, hold the chain at the fork and mark it idle (one
        backend call), and maybe schedule the canonical branch. Returns the
        step's accounting with the real next context. `chain`: the chain as the
        step's own answer reported it, if it did."""
        record.closed = True
        self.backend.drop_host_copy(conv.id)  # the tool chain's copy will not be reloaded
        settings, dropped = conv.materialize, None
        if conv.policy.name == "auto" and self.backend.holds_kv:
            reported = chain  # the step's own report of the pool, where it made one
            choice, settings, dropped = self._auto_close(conv, tpl, record, generated, acc,
                                                         (lambda: reported.free_fraction) if reported is not None
                                                         else self.backend.free_fraction)
            record.auto = choice.as_dict()
            if choice.choice != "drop":
                dropped = None  # kept: the canonical history is another
        conv.history, canonical = dropped or _canonical(tpl, conv, conv.kept_reasoning())
        fork = turn_rules.common_prefix(generated, canonical)
        record.fork_tokens = fork
        acc = dataclasses.replace(acc, active_context_length=len(canonical))
        materialize: Optional[bool] = None  # this turn's real decision, when one is made
        conv.canonical_kind = "generated" if fork >= len(generated) else "prefix"  # generated: nothing dropped
        forks = fork < len(generated) and conv.policy.holds_chain
        record.dropped_tokens = len(generated) - fork
        record.branch_freed = forks and conv.policy.may_materialize
        if conv.policy.holds_chain:
            # A's KV was computed after R: past the fork nothing may be reused. Hold
            # the shared prefix (its partial page copied); a dropping policy frees
            # the generated branch at once, where no other chain or step holds it.
            try:
                closed = self.backend.close_turn(conv.id, ns, canonical[:fork] if forks else None,
                                                 free_branch=conv.policy.may_materialize,
                                                 idle_ttl_s=self.idle_ttl_s)
                # None: the close is sent after this step answers; the chain will hold the fork
                # (the step's report held the whole sequence).
                chain = closed if closed is not None or chain is None else dataclasses.replace(
                    chain, tokens=min(fork, chain.tokens) if forks else chain.tokens)
            except BackendUnavailable as exc:
                # The chain's worker went down after the step finished: there is no
                # chain to hold there now. The step stands; the conversation moves
                # and its next step prefills its history elsewhere (recomputed).
                chain, forks = ChainState(0, 0, 0.0), False
                record.materialize = f"skipped: the chain's worker is gone ({exc})"
        free = (lambda: chain.free_fraction) if chain is not None else self.backend.free_fraction
        if forks and conv.policy.may_materialize:
            materialize, why = settings.decide(
                reasoning_tokens=len(generated) - fork - (len(canonical) - fork),
                answer_tokens=_dropped_answer(tpl, conv, len(canonical)) - fork,
                free_fraction=free,
                idle=self.materializer.waiting_users == 0,  # this request has already left
            )
            record.materialize = ("scheduled: " if materialize else "skipped: ") + why
            if materialize:
                self.materializer.submit(conv.id, canonical, ns)
        # Under drop the shadow of drop is this very chain: the same decision, not a second one.
        # A sampled step's last token was never fed (it has no KV), under either policy.
        unfed = min(max(0, len(generated) - len(conv.chain_tokens)), len(conv.trace[-1].message.output_ids))
        if not self.backend.wants_transcript:  # upstream mode has no KV to weigh keep against drop by
            self._shadow(conv, tpl, record, materialize if conv.policy.name == "drop" else None, unfed, free)
        return self._chain_bytes(conv, acc, chain)

    def redrop(self, conv: Conversation, tpl: Template) -> Optional["Redrop"]:
        """Policy auto at a turn's first step: the closed turns it kept whose
        reasoning the chain no longer holds (evicted, a restart, a dead worker,
        released), since it would be prefilled again anyway, dropped where the
        model says it pays (it does whenever there is reasoning to drop).
        None: nothing to drop. Changes no layer."""
        closed = conv.closed_turns
        kept = [t.index for t in conv.turns if t.closed and t.auto is not None and t.auto["choice"] == "keep"]
        if not kept or not self.backend.holds_kv:
            return None
        try:
            device = self.backend.peek_chain_tokens(conv.id)
            bpt = self.backend.bytes_per_token
            held = (device or 0) + (self.backend.host_bytes(conv.id) // bpt if bpt else 0)
        except BackendUnavailable:
            return None
        if device is None:  # not known yet: nothing is decided on a guess
            return None
        keep, history = conv.kept_reasoning(), conv.history
        first_output = {}
        for i, m in enumerate(history):
            if m.role == "assistant":
                first_output.setdefault(m.turn, i)
        gone = tuple(t for t in kept if t in first_output and
                     tpl.rendered_length(conv.system, conv.tools, history[:first_output[t]], keep, True) >= held)
        if not gone:
            return None
        after = conv.policy.kept_turns(closed, frozenset(kept) - set(gone))
        dropped = _without_reasoning(tpl, history, after)
        now = tpl.rendered_length(conv.system, conv.tools, history, keep, False)
        then = tpl.rendered_length(conv.system, conv.tools, dropped, after, False)
        computed = _computed_tokens(conv.turns[-1].steps if conv.turns else [])
        rest = self.auto.outlooks.outlook(conv.id, conv.tenant, closed + 1, 0.0, computed)
        # The turn is here: its tokens and the rest's see the reasoning kept, and it is prefilled now.
        outlook = dataclasses.replace(rest, next_turn=1.0, turns=1.0 + rest.turns)
        choice = self.auto.choose(TurnShape(reasoning=now - then, tail=0, fork=min(held, then)), outlook,
                                  reason="not_resident")
        return Redrop(gone, dropped, after, choice) if choice.choice == "drop" else None

    def _auto_close(self, conv: Conversation, tpl: Template, record: TurnRecord, generated: list[int], acc,
                    free_fraction) -> tuple[AutoChoice, "MaterializeSettings", tuple[list[Message], list[int]]]:
        """Policy auto at the close of `record`'s turn (closed, no choice yet, so
        dropped by `kept_reasoning`): the turn's shape from the history
        rendered with its reasoning dropped against the generated sequence,
        the conversation's outlook, the choice; and the materialize settings
        with the outlook's chance of another turn, which decide the canonical
        branch if it drops (and whether dropping would build it, for the
        choice); and the canonical history and ids with it dropped. Changes
        no layer."""
        dropped = _canonical(tpl, conv, conv.kept_reasoning())
        drop_ids = dropped[1]
        fork = turn_rules.common_prefix(generated, drop_ids)
        shape = TurnShape(reasoning=len(generated) - len(drop_ids), tail=len(drop_ids) - fork, fork=fork)
        computed = _computed_tokens([*record.steps, acc])
        outlooks = self.auto.outlooks
        outlooks.turn_closed(conv.id, conv.tenant, computed)
        if shape.reasoning <= 0:  # nothing to drop: the pool is not asked
            return self.auto.choose(shape, outlooks.outlook(conv.id, conv.tenant, conv.closed_turns, 1.0, computed)), \
                conv.materialize, dropped
        free = free_fraction()
        floor = conv.materialize.min_free_fraction
        resident = 1.0 if floor <= 0 else min(1.0, free / floor)
        outlook = outlooks.outlook(conv.id, conv.tenant, conv.closed_turns, resident, computed)
        settings = dataclasses.replace(conv.materialize, continue_probability=outlook.next_turn)
        builds, _ = settings.decide(reasoning_tokens=shape.reasoning, answer_tokens=shape.tail, free_fraction=free,
                                    idle=self.materializer.waiting_users == 0)
        return self.auto.choose(shape, outlook, float(builds)), settings, dropped

    def _shadow(self, conv: Conversation, tpl: Template, record: TurnRecord,
                drop_materializes: Optional[bool] = None, unfed: int = 0, free_fraction=None) -> None:
        """Set `conv.shadows`: the chains (token ids, no KV) that the keep and drop
        policies would hold now that turn `record.index` closed, had the
        conversation run under each from its first turn, so that the next turn's
        counterfactual is what that policy really pays, on every turn.

        Each policy's generated sequence of this turn is its own rendering of the
        trace before the closing output, plus that output (less its `unfed` last
        tokens, which have no KV): every turn's reasoning under keep, only this
        turn's under drop. Keep holds it whole. Drop holds
        its common prefix with drop's canonical sequence (this turn's reasoning
        dropped too), or the whole canonical sequence when drop would materialize
        the branch under the conversation's own materialize setting:
        `drop_materializes` is the real decision when the conversation runs drop;
        otherwise the same `decide` is asked with drop's figures."""
        trace = conv.trace_messages()
        *before, last = trace
        t = record.index

        def generated(keep) -> list[int]:
            ids = tpl.render(conv.system, conv.tools, before, keep, True).ids + list(last.output_ids)
            return ids[: len(ids) - unfed]

        keep_chain, drop_generated = generated(turn_rules.keep_all), generated(turn_rules.keep_from(t))
        canonical = tpl.render(conv.system, conv.tools, trace, turn_rules.keep_from(t + 1), False).ids
        fork = turn_rules.common_prefix(drop_generated, canonical)
        if drop_materializes is None and fork < len(drop_generated):
            drop_materializes, _ = conv.materialize.decide(
                reasoning_tokens=len(drop_generated) - len(canonical), answer_tokens=len(canonical) - fork,
                free_fraction=free_fraction or self.backend.free_fraction, idle=self.materializer.waiting_users == 0)
        conv.shadows = {"keep": keep_chain, "drop": canonical if drop_materializes else canonical[:fork]}

    def _chain_bytes(self, conv: Conversation, acc, chain: Optional[ChainState]):
        """The step's KV figures as the closed turn left the chain."""
        if not conv.policy.holds_chain:
            return acc  # nothing is held: the figures are what the step inserted
        if chain is None:
            chain = ChainState(self.backend.chain_tokens(conv.id), self.backend.host_bytes(conv.id), 0.0)
        return dataclasses.replace(acc, kv_device_bytes=chain.tokens * self.backend.bytes_per_token,
                                   kv_host_bytes=chain.host_bytes)


def apply_redrop(conv: Conversation, redrop: Redrop, turn: int) -> None:
    """Write what `TurnClose.redrop` found into the history and each turn's record
    (replaced, so that the store writes them again)."""
    conv.history = redrop.history
    for k, record in enumerate(conv.turns):
        if record.index in redrop.turns:
            conv.turns[k] = dataclasses.replace(record, auto={**redrop.choice.as_dict(), "decided_at_turn": turn,
                                                              "kept_at_close": record.auto})


@dataclasses.dataclass(frozen=True)
class Redrop:
    """Kept turns policy auto drops at a turn's first step, the chain being gone."""

    turns: tuple[int, ...]
    history: list[Message]  # the canonical history with their reasoning dropped
    keep: object  # the KeepReasoning after it
    choice: AutoChoice

    def rule(self) -> dict:
        return {"rule": "auto", "reason": self.choice.reason, "dropped_turns": list(self.turns),
                "reasoning_tokens": self.choice.shape.reasoning}


def _canonical(tpl: Template, conv: Conversation, keep) -> tuple[list[Message], list[int]]:
    """The conversation's history with the reasoning `keep` does not keep
    stripped, and its rendering without a generation prompt."""
    history = _without_reasoning(tpl, conv.history, keep)
    return history, tpl.render(conv.system, conv.tools, history, keep, False).ids


def _dropped_answer(tpl: Template, conv: Conversation, canonical: int) -> int:
    """Where the closed turns whose reasoning is dropped end in the canonical
    sequence (`canonical` tokens long): before the first closed turn that keeps
    its reasoning (keep_last_k's), whose tokens past the fork are no answer of
    a dropped turn, though they are prefilled again with it."""
    keep, history = conv.kept_reasoning(), conv.history
    start = keeping_starts(keep, history)  # one bisection where `keep` is a threshold
    if start is not None and (start == len(history) or history[start].role == "user"):
        kept = start if start < len(history) else None
    else:
        kept = next((i for i, m in enumerate(history) if m.role == "user" and keep(m.turn)), None)
    if kept is None:
        return canonical
    return tpl.rendered_length(conv.system, conv.tools, conv.history[:kept], keep, False)


def _computed_tokens(steps) -> int:
    """Tokens some steps computed: their prefill and their output."""
    return sum((s.uncached_prefill_tokens or 0) + s.output_tokens for s in steps)


_reasoning = operator.attrgetter("reasoning")


def _without_reasoning(tpl: Template, history: list[Message], keep) -> list[Message]:
    """`history` with the reasoning of the assistant messages whose turns do not
    keep it stripped. Only messages that still carry reasoning before the first
    kept turn are looked at, found in C: at a turn's close that is the closed
    turn's (and, over a client's history, whatever it brought), not the whole
    conversation."""
    end = keeping_starts(keep, history)
    carrying = compress(range(len(history) if end is None else end), map(_reasoning, history))
    out = list(history)
    for i in carrying:
        m = history[i]
        if m.role == "assistant" and not keep(m.turn):
            out[i] = tpl.strip_reasoning(m)
    return out
