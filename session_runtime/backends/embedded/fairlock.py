"""The embedded engine's lock: reentrant, handed over in arrival order.

A running step calls `yield_to_waiters` after every decoded token and every
prefill chunk: whoever waits (another step, a reload, `/metrics`' gauges, a
tree snapshot) goes first, in FIFO order, and the step continues after them. A
1-token request therefore waits for one forward of a long generation, not for
all of it; `threading.RLock` gives no such order (a releasing thread usually
takes it straight back)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional


class FairRLock:
    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._owner: Optional[int] = None
        self._depth = 0
        self._queue: deque[object] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            return self._wait_turn(me, 1, None if timeout < 0 else timeout)

    def _wait_turn(self, me: int, depth: int, timeout: Optional[float]) -> bool:
        """Queue up and wait until the lock is free and this ticket is first. Called with _cv held."""
        ticket = object()
        self._queue.append(ticket)
        if not self._cv.wait_for(lambda: self._owner is None and self._queue[0] is ticket, timeout):
            self._queue.remove(ticket)
            self._cv.notify_all()
            return False
        self._queue.popleft()
        self._owner, self._depth = me, depth
        return True

    def release(self) -> None:
        with self._cv:
            assert self._owner == threading.get_ident(), "release of a lock this thread does not hold"
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cv.notify_all()

    def yield_to_waiters(self) -> bool:
        """Let everyone queued now go first, then take the lock back at the same
        depth. Returns whether anyone was waiting."""
        me = threading.get_ident()
        with self._cv:
            assert self._owner == me, "only the holder yields the lock"
            if not self._queue:
                return False
            depth = self._depth
            self._owner, self._depth = None, 0
            self._cv.notify_all()
            self._wait_turn(me, depth, None)
            return True

    def waiting(self) -> int:
        return len(self._queue)

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()
