"""The `auto` reasoning policy: at each turn's close, keep or drop that turn's
reasoning by what each costs over the conversation's expected rest.

Priced in the replay's cost model (replay/economics.py: FLOPs of prefill and
attention for a model shape, and KV token-seconds at a price in FLOPs), so the
live choice and the replay's verdict weigh the same things. At a turn's close
the runtime knows:

- the turn's shape (`TurnShape`): |R|, the tokens dropping removes from the
  context; the tail after the fork that dropping prefills again (the answer,
  and the tool chain's calls and results); the fork, the context they follow;
- the conversation's outlook (`Outlook`, learned by `Outlooks` from its own
  and its tenant's turns): the chance of another user turn and the expected
  number of them, the seconds from one turn's start to the next, the tokens a
  turn computes, and the chance the chain is still on the device then (the
  pool's pressure).

Over dropping, keeping costs |R| tokens of KV held for every second the
conversation goes on, |R| more context for every token it computes later, and,
where the chain is gone by the next turn, |R| more prefill then. Over keeping,
dropping costs the tail's prefill on the fork, once, where the chain is still
there (gone, both prefill everything and drop's prompt is the shorter): for
certain where the canonical branch is built in idle time, else only if
another turn comes, and until then keeping holds the tail too. The cheaper is
chosen; a tie keeps (no work, no fork), so a conversation about to end keeps.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from session_runtime.cost_model import CostModel, prefill_work


@dataclass(frozen=True)
class TurnShape:
    """A closed turn's figures, in tokens."""

    reasoning: int  # |R|: what dropping removes from the context
    tail: int  # what dropping prefills again after the fork (answer, tool calls and results)
    fork: int  # the tokens the kept and the dropped sequences share


@dataclass(frozen=True)
class Outlook:
    """What the rest of a conversation is expected to be, at a turn's close."""

    next_turn: float  # the chance that another user turn comes
    turns: float  # the expected number of further user turns
    period_s: float  # seconds from one turn's start to the next's
    gap_s: float  # of those, seconds from a turn's close to the next user message
    turn_tokens: float  # tokens a later turn computes (its prefill and its output)
    resident: float  # the chance the chain is still resident at the next turn


@dataclass(frozen=True)
class AutoChoice:
    """What auto chose for one turn and the two costs it compared (FLOPs, each
    over the other choice, expected over the conversation's rest)."""

    choice: str  # keep or drop
    keep_cost: float
    drop_cost: float
    reason: str  # close: decided at the turn's close; not_resident: dropped later, the chain being gone
    shape: TurnShape
    outlook: Outlook

    def as_dict(self) -> dict:
        return {"choice": self.choice, "keep_cost_flops": self.keep_cost, "drop_cost_flops": self.drop_cost,
                "reason": self.reason, **asdict(self.shape), "outlook": asdict(self.outlook)}


def choose(shape: TurnShape, outlook: Outlook, cm: CostModel, kv_price: float, materialized: float = 0.0,
           reason: str = "close") -> AutoChoice:
    """Keep or drop one turn's reasoning (see the module's docstring).
    `materialized`: the chance that dropping builds the canonical branch in
    idle time (its prefill is then certain; lazily it waits for the next
    turn, and until then only the fork is held, so keeping holds the tail
    too)."""
    r, tail, fork = shape.reasoning, shape.tail, shape.fork
    if r <= 0:  # dropping would shorten nothing
        return AutoChoice("keep", 0.0, 0.0, reason, shape, outlook)
    chunk = cm.prefill_chunk
    held = kv_price * (r * outlook.turns * outlook.period_s
                       + tail * (1.0 - materialized) * outlook.next_turn * outlook.gap_s)
    attention = cm.attention_flops_per_context * r * outlook.turns * outlook.turn_tokens
    refill = prefill_work(fork + r + tail, 0, chunk).flops(cm) - prefill_work(fork + tail, 0, chunk).flops(cm)
    keep = held + attention + outlook.next_turn * (1.0 - outlook.resident) * refill
    # Built in idle time, the canonical branch is prefilled now, next turn or not; else at the next turn.
    prefilled = materialized + (1.0 - materialized) * outlook.next_turn
    drop = prefilled * outlook.resident * prefill_work(tail, fork, chunk).flops(cm)
    return AutoChoice("drop" if drop < keep else "keep", keep, drop, reason, shape, outlook)


# ----- learning the outlook ----------------------------------------------------------------

_EVERYONE = ("every tenant",)  # a key no tenant name equals
PRIOR_CONTINUE = 0.8  # the chance of another turn before anything is seen (MaterializeSettings' default)
PRIOR_WEIGHT = 2.0  # how many observed turns that guess is worth
# Seconds a turn cycle takes, and of it the wait for the next user message,
# before any is seen: the replay's nominal clock for a one-step turn.
PRIOR_PERIOD_S = 62.0
PRIOR_GAP_S = 60.0
HORIZON = 256  # turns the expected rest is summed over
_PACE = 0.5  # weight of the newest observation in the running means


def _mean(old: Optional[float], new: float) -> float:
    return new if old is None else old + _PACE * (new - old)


@dataclass
class _Pace:
    """Running means of a conversation's (or a tenant's) turn cycle and tokens."""

    period_s: Optional[float] = None
    gap_s: Optional[float] = None
    turn_tokens: Optional[float] = None
    closed_at: Optional[float] = None  # when its last turn closed (a conversation's own)


@dataclass
class _Tenant:
    pace: _Pace
    continued: Counter  # closed turns -> conversations that went on to another turn from there
    ended: Counter  # closed turns -> conversations that ended there (deleted, expired)


class Outlooks:
    """What the runtime has seen of its conversations' lengths and pace, per
    tenant and per conversation, to expect their rest from. In memory only: a
    restart starts from the priors again. `clock` gives seconds (the replay
    sets the trace's own). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time, max_conversations: int = 1 << 16):
        self.clock = clock
        self.max_conversations = max_conversations
        self._lock = threading.Lock()
        self._tenants: dict[Optional[str], _Tenant] = {}
        self._convs: dict[str, tuple[_Pace, Optional[float]]] = {}  # pace, when its last turn started

    def _tenant(self, tenant: Optional[str]) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(_Pace(), Counter(), Counter())
        return t

    def _all(self) -> _Tenant:
        """Every tenant's conversations together: the prior of a tenant's own."""
        return self._tenant(_EVERYONE)

    def turn_opened(self, cid: str, tenant: Optional[str], closed_turns: int) -> None:
        """A user message opened a turn after `closed_turns` closed ones."""
        now = self.clock()
        with self._lock:
            t = self._tenant(tenant)
            pace, started = self._convs.pop(cid, (_Pace(), None))
            if closed_turns:
                t.continued[closed_turns] += 1
                self._all().continued[closed_turns] += 1
            if started is not None and now >= started:
                pace.period_s = _mean(pace.period_s, now - started)
                t.pace.period_s = _mean(t.pace.period_s, now - started)
            if pace.closed_at is not None and now >= pace.closed_at:
                pace.gap_s = _mean(pace.gap_s, now - pace.closed_at)
                t.pace.gap_s = _mean(t.pace.gap_s, now - pace.closed_at)
            self._convs[cid] = (pace, now)  # most recent last
            while len(self._convs) > self.max_conversations:
                del self._convs[next(iter(self._convs))]

    def turn_closed(self, cid: str, tenant: Optional[str], computed_tokens: int) -> None:
        """A turn closed, having computed this many tokens (prefill and output)."""
        now = self.clock()
        with self._lock:
            t = self._tenant(tenant)
            pace, _ = self._convs.get(cid, (None, None))
            if pace is not None:
                pace.turn_tokens = _mean(pace.turn_tokens, computed_tokens)
                pace.closed_at = now
            t.pace.turn_tokens = _mean(t.pace.turn_tokens, computed_tokens)

    def ended(self, cid: str, tenant: Optional[str], closed_turns: int) -> None:
        """The conversation is gone (deleted, expired) after `closed_turns` turns."""
        with self._lock:
            self._convs.pop(cid, None)
            self._tenant(tenant).ended[closed_turns] += 1
            self._all().ended[closed_turns] += 1

    def outlook(self, cid: str, tenant: Optional[str], closed_turns: int, resident: float,
                turn_tokens: int) -> Outlook:
        """The conversation's expected rest now that `closed_turns` turns closed.
        `turn_tokens`: what the turn that just closed computed (the guess where
        nothing else is known)."""
        now = self.clock()
        with self._lock:
            t = self._tenant(tenant)
            pace, started = self._convs.get(cid, (_Pace(), None))
            period = pace.period_s if pace.period_s is not None else t.pace.period_s
            # The turn under way has lasted this long already: a cycle is at least that.
            running = now - started if started is not None else 0.0
            period = max(period if period is not None else PRIOR_PERIOD_S, running)
            gap = pace.gap_s if pace.gap_s is not None else t.pace.gap_s
            gap = min(gap if gap is not None else PRIOR_GAP_S, period)
            tokens = pace.turn_tokens if pace.turn_tokens is not None else t.pace.turn_tokens
            next_turn, turns = self._rest(t, self._all(), closed_turns)
        return Outlook(next_turn, turns, period, gap, tokens if tokens is not None else float(turn_tokens), resident)

    def _rest(self, t: _Tenant, everyone: _Tenant, closed: int) -> tuple[float, float]:
        """(the chance of another turn, the expected number of them) after
        `closed` turns: at each turn count, the rate at which conversations
        ended there (of those that reached it and went on or ended), the
        tenant's smoothed toward every tenant's, smoothed toward the prior.
        Under the lock."""
        prior = 1.0 - PRIOR_CONTINUE
        alive, expected, first = 1.0, 0.0, None
        for k in range(closed, closed + HORIZON):
            e, c = everyone.ended.get(k, 0), everyone.continued.get(k, 0)
            pooled = (e + PRIOR_WEIGHT * prior) / (e + c + PRIOR_WEIGHT)
            e, c = (t.ended.get(k, 0), t.continued.get(k, 0)) if t is not everyone else (0, 0)
            hazard = (e + PRIOR_WEIGHT * pooled) / (e + c + PRIOR_WEIGHT)
            alive *= 1.0 - hazard
            first = alive if first is None else first
            expected += alive
            if alive < 1e-4:
                break
        return first, expected


# ----- the policy's part of a runtime ------------------------------------------------------


class AutoPolicy:
    """The runtime's auto policy: its cost model and KV price (the replay's,
    from RuntimeConfig: `cost_model` or the model's own shape, `cost_dtype`,
    `kv_price` or economics' default), the outlooks it learns, and a count of
    its choices (for /metrics)."""

    def __init__(self, model: str, cost_dtype: str = "bfloat16", prefill_chunk: int = 2048,
                 kv_price: Optional[float] = None, clock: Callable[[], float] = time.time):
        self._spec = (model, cost_dtype, prefill_chunk)
        self._kv_price = kv_price
        self._cost: Optional[CostModel] = None
        self.outlooks = Outlooks(clock)
        self._choices: Counter = Counter()  # (choice, reason) -> turns
        self._lock = threading.Lock()

    @property
    def cost(self) -> CostModel:
        """The model shape choices are priced for. Raises InvalidRequest where
        the model is neither a preset nor a folder with config.json."""
        if self._cost is None:
            from session_runtime.errors import InvalidRequest
            from session_runtime.cost_model import cost_model

            try:
                self._cost = cost_model(*self._spec)
            except ValueError as exc:
                raise InvalidRequest(f"policy auto prices each turn for the model's shape: {exc}") from None
        return self._cost

    @property
    def kv_price(self) -> float:
        """FLOPs one KV token-second is worth."""
        if self._kv_price is None:
            from session_runtime.cost_model import default_kv_price

            self._kv_price = default_kv_price(self.cost)
        return self._kv_price

    def counts(self) -> dict[tuple[str, str], int]:
        """Turns chosen so far by (choice, reason)."""
        with self._lock:
            return dict(self._choices)

    def choose(self, shape: TurnShape, outlook: Outlook, materialized: float = 0.0,
               reason: str = "close") -> AutoChoice:
        """`choose` at this policy's prices, counted."""
        choice = choose(shape, outlook, self.cost, self.kv_price, materialized, reason)
        with self._lock:
            self._choices[(choice.choice, reason)] += 1
        return choice
