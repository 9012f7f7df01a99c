"""The embedded engine's tool-wait offload manager: the policies of
session_runtime/offload.py (its shared tables and decisions) applied to the
engine's pools, on a worker thread of its own."""

from __future__ import annotations

import time
from typing import Callable, Optional

from session_runtime.offload import OffloadSettings, WaitTable, due_owners


class OffloadManager(WaitTable):
    """Tracks conversations waiting for tools and demotes them by policy, on a
    worker thread (or on `run_due()` when built with background=False).
    Settings None in the table: idle after a closed turn. `engine`: the
    embedded Engine (engine.py), which builds its manager with itself."""

    def __init__(self, engine, background: bool = True, poll_s: float = 0.05, idle_ttl_s: float = 0.0):
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
