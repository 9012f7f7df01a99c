"""Tool-wait offload policies for the SGLang backend. The copies run inside
the scheduler (`radix_ext/sglang/offload.py`); this side decides when:

- never: nothing moves;
- always / discard: demote (discard: free without a copy) as the wait starts;
- ttl: demote once the wait is `ttl_s` old;
- pressure: the scheduler is told the conversation waits, and demotes it itself
  when a waiting request cannot be admitted (it sees the pressure, we do not).

A demotion and the end of the same wait are serialized per conversation, so no
demotion lands after the next step has started.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from session_runtime.errors import BackendUnavailable
from session_runtime.offload import WaitTable, due_owners


class SchedulerOffload(WaitTable):
    thread_name = "offload-sglang"

    def __init__(self, backend, background: bool = True, poll_s: float = 0.05):
        self.backend = backend
        self._owner_locks: dict[str, threading.Lock] = {}
        super().__init__(background, poll_s)

    def _lock(self, owner: str) -> threading.Lock:
        with self.cond:
            return self._owner_locks.setdefault(owner, threading.Lock())

    def wait_started(self, owner: str, settings) -> None:
        if settings.mode == "never":
            return
        self.backend.expect_host(owner)
        if settings.mode == "pressure":
            self._quiet(self.backend.mark_waiting, owner)
            return
        with self.cond:
            self.waiting[owner] = (time.monotonic(), settings)
            self.cond.notify_all()

    def idle_started(self, owner: str) -> None:
        pass  # the scheduler retires idle chains (backend.mark_idle)

    def wait_ended(self, owner: str):
        with self._lock(owner):  # after a demotion of this wait that already started
            with self.cond:
                return self.waiting.pop(owner, None)

    def forget(self, owner: str) -> None:
        self.wait_ended(owner)
        with self.cond:
            self._owner_locks.pop(owner, None)

    def due(self, now: Optional[float] = None) -> list[str]:
        with self.cond:
            waiting = dict(self.waiting)
        # Pressure and idle chains are the scheduler's to decide (it sees the pool).
        return due_owners(waiting, time.monotonic() if now is None else now)

    def run_due(self, now: Optional[float] = None) -> int:
        """Demote every conversation due now. Returns the tokens moved."""
        total = 0
        for owner in self.due(now):
            with self._lock(owner):
                with self.cond:
                    entry = self.waiting.pop(owner, None)
                if entry is None:
                    continue  # its step started meanwhile
                total += self._quiet(self.backend.demote, owner, entry[1].mode != "discard") or 0
        return total

    def _quiet(self, fn, *args):
        try:
            return fn(*args)
        except BackendUnavailable:
            return None  # a server that is gone holds nothing to move
