"""Tool-wait offload policies: when a conversation waits for tool results, its
KV may move to the host tier and come back before the next step's prefill.

- never: the KV stays on the device;
- always: demote as soon as the step ends in tool calls;
- ttl: demote after `ttl_s` seconds of waiting (as in Continuum);
- pressure: demote when free device pages fall below `min_free_fraction`, or an
  allocation cannot be met, least-recently-waiting conversations first;
- discard (baseline, InferCept's "discard"): free the KV at once, recompute on resume.

Idle retirement: a conversation whose turn closed is idle until its next
step. Idle longer than `idle_ttl_s`, its chain is demoted to the host tier (or,
with the host full, released to LRU); when an allocation cannot be met, idle
chains leave the device first (oldest first), before waiting conversations.
Idle conversations share the waiting table, with settings None.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from session_runtime.errors import InvalidRequest

if TYPE_CHECKING:  # the decisions here import nothing heavy (bench/scale_sim.py uses them)
    from session_runtime.backends.embedded.engine import Engine

OFFLOAD_MODES = ("never", "always", "ttl", "pressure", "discard")


@dataclass(frozen=True)
class OffloadSettings:
    mode: str = "pressure"
    ttl_s: float = 2.0
    min_free_fraction: float = 0.10

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise InvalidRequest(f"offload must be one of {', '.join(OFFLOAD_MODES)}; got {self.mode!r}")
        if self.ttl_s < 0 or not 0.0 <= self.min_free_fraction <= 1.0:
            raise InvalidRequest("ttl_s must be >= 0 and min_free_fraction within [0, 1]")


def due_owners(waiting: Mapping[str, tuple[float, Optional[OffloadSettings]]], now: float,
               free_fraction: float = 1.0, idle_ttl_s: float = 0.0) -> list[str]:
    """The offload decision, a pure function of the state it reads (the runtime
    and bench/scale_sim.py both call it): the owners whose wait is due for
    demotion at `now`, oldest wait first. Settings None is an idle chain (due
    after `idle_ttl_s`, 0 = never); pressure waits are due while the pool's
    free fraction is below their threshold."""
    order = sorted(waiting.items(), key=lambda kv: kv[1][0])
    return [owner for owner, (since, s) in order
            if (s is None and idle_ttl_s > 0 and now - since >= idle_ttl_s) or (s is not None and (
                s.mode in ("always", "discard") or (s.mode == "ttl" and now - since >= s.ttl_s)
                or (s.mode == "pressure" and free_fraction < s.min_free_fraction)))]


class NoOffload:
    """A backend without a host tier: tool waits are not tracked, KV stays on the device."""

    def wait_started(self, owner: str, settings: OffloadSettings) -> None:
        pass

    def idle_started(self, owner: str) -> None:
        pass

    def wait_ended(self, owner: str) -> None:
        return None

    def wait_resumed(self, owner: str, wait) -> None:
        pass

    def forget(self, owner: str) -> None:
        pass

    def close(self) -> None:
        pass


class WaitTable:
    """Conversations' waits (owner -> (since, settings)) and the worker thread
    that calls `run_due` while any is tracked (or nothing, with background=False:
    tests and benchmarks call `run_due` themselves). Subclasses decide what is due."""

    thread_name = "offload"

    def __init__(self, background: bool = True, poll_s: float = 0.05):
        self.waiting: dict[str, tuple[float, Optional[OffloadSettings]]] = {}
        self.cond = threading.Condition()
        self.poll_s = poll_s
        self._stop = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self._thread.start()

    def run_due(self, now: Optional[float] = None) -> int:
        raise NotImplementedError

    def wait_resumed(self, owner: str, wait) -> None:
        """Put back a wait that a failed step had ended, with its original start
        (a ttl keeps counting from when the tool call was made)."""
        if wait is not None:
            with self.cond:
                self.waiting[owner] = wait
                self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                if self._stop:
                    return
                if not self.waiting:
                    self.cond.wait(timeout=0.5)
                    continue
            self.run_due()
            time.sleep(self.poll_s)

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


class OffloadManager(WaitTable):
    """Tracks conversations waiting for tools and demotes them by policy, on a
    worker thread (or on `run_due()` when built with background=False).
    Settings None in the table: idle after a closed turn."""

    def __init__(self, engine: "Engine", background: bool = True, poll_s: float = 0.05, idle_ttl_s: float = 0.0):
        self.engine = engine
        self.idle_ttl_s = idle_ttl_s
        self.stats = {"idle_demoted": 0, "idle_released": 0}
        engine.on_pressure = self._on_pressure
        super().__init__(background, poll_s)

    def wait_started(self, owner: str, settings: OffloadSettings) -> None:
        if settings.mode == "never":
            return
        with self.cond:
            self.waiting[owner] = (time.monotonic(), settings)
            self.cond.notify_all()

    def idle_started(self, owner: str) -> None:
        """The owner's turn closed with its chain held: idle until its next step."""
        with self.cond:
            self.waiting[owner] = (time.monotonic(), None)
            self.cond.notify_all()

    def wait_ended(self, owner: str) -> Optional[tuple[float, Optional[OffloadSettings]]]:
        """Stop tracking the owner's wait; returns it, for `wait_resumed`."""
        with self.cond:
            return self.waiting.pop(owner, None)

    def forget(self, owner: str) -> None:
        """The conversation is gone: drop its host copy (or its record of a lost one) too."""
        self.wait_ended(owner)
        with self.engine.lock:  # after any demotion that passed its guard has finished
            self.engine.host.take(owner)
            self.engine.host.forget_evicted(owner)

    def free_fraction(self) -> float:
        """Device pages free or reclaimable (unlocked cache) over the pool."""
        pools = self.engine.pools
        return (pools.allocator.available_size() + self.engine.tree.evictable_size()) / pools.capacity

    def due(self, now: Optional[float] = None) -> list[str]:
        """Owners whose policy says demote now, least recently waiting first.
        Pressure waiters are listed while the pool is short; `run_due` stops
        demoting them once enough is free."""
        now = time.monotonic() if now is None else now
        short = self.free_fraction()
        with self.cond:
            waiting = dict(self.waiting)
        return due_owners(waiting, now, short, self.idle_ttl_s)

    def run_due(self, now: Optional[float] = None) -> int:
        """Demote every conversation due now (pressure ones only until the pool
        is above their threshold again). Returns the tokens moved off the device."""
        total = 0
        for owner in self.due(now):
            with self.cond:
                entry = self.waiting.get(owner)
            if entry is None:
                continue
            if entry[1] is None:
                total += self._retire(owner, self._guard(owner, entry[0]), locked=False)
                continue
            mode = entry[1].mode
            if mode == "pressure" and self.free_fraction() >= entry[1].min_free_fraction:
                continue
            guard = self._guard(owner, entry[0])
            if mode == "discard":
                moved = self.engine.discard(owner, guard)
            else:
                moved = self.engine.demote(owner, guard)
            total += moved
            with self.engine.lock:  # a step elsewhere may be splitting nodes
                done = moved or self.engine.tree.plan_demote(owner) is None
            if done:
                self.wait_ended(owner)  # nothing (more) to move for this wait
        return total

    def _on_pressure(self, missing: int) -> None:
        # Inside an allocation (engine lock held): idle chains leave the device
        # first, then waiting conversations are demoted, oldest first, until the
        # missing tokens are free or reclaimable.
        with self.cond:
            order = sorted(self.waiting.items(), key=lambda kv: (kv[1][1] is not None, kv[1][0]))
        freed = 0
        for owner, (since, settings) in order:
            if freed >= missing:
                break
            if owner in self.engine.stepping:
                continue  # the chain this allocation extends
            if settings is None:
                freed += self._retire(owner, self._guard(owner, since), locked=True)
                continue
            moved = self.engine.demote_locked(owner, self._guard(owner, since))
            if moved:
                freed += moved
                self.wait_ended(owner)

    def _retire(self, owner: str, guard: Callable[[], bool], locked: bool) -> int:
        """An idle chain leaves the device: demoted to the host tier when it has
        room, else released (its pages become evictable; the next turn rebuilds
        what LRU took). Returns the tokens that left the device or became
        evictable."""
        moved = (self.engine.demote_locked if locked else self.engine.demote)(owner, guard)
        if moved:
            self.stats["idle_demoted"] += 1
        else:
            moved = self.engine.release_idle(owner, guard)
            self.stats["idle_released"] += bool(moved)
        self.wait_ended(owner)
        return moved

    def _guard(self, owner: str, since: float) -> Callable[[], bool]:
        """True while the same tool wait of `owner` is still on: a step that
        started or a delete ends it, and a demotion checks this under the engine
        lock before it plans and before it finishes."""
        def still() -> bool:
            with self.cond:
                current = self.waiting.get(owner)
            return current is not None and current[0] == since
        return still
