"""What the tree does after a step, off the step's path, in order per conversation.

A turn's close (hold the chain at the fork, free the branch past it, mark it
idle) and the start of a tool wait are commands the runtime can send only once
it has parsed the step's output. They wait here, after the step has answered
its client, so a step costs one request to the server:

- for up to `ride_s` they may ride the conversation's next request (its next
  step, or its canonical branch): `take` hands them to that request, whose
  `kv_hints` carry them and whose intake runs them first, in order, on every
  rank; an agent that steps again at once pays no round trip for its close;
- after `ride_s`, or when something else must see the tree first (`settle`),
  a small pool of threads sends each as a command request of its own.

Order is kept per conversation: a command sent on its own waits for the one
queued before it for the same conversation, and anything that reads or
changes that conversation's chain (its next step, a canonical branch, a
release, `/debug/tree`) first takes or waits for what is queued (`settle`).
The pool picks commands in the order they were queued, so a command never
waits on one queued after it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Optional

logger = logging.getLogger(__name__)


Command = tuple[str, dict]  # (name, args): what a riding command carries


class OwnerQueue:
    def __init__(self, workers: int = 4, name: str = "sglang-after", ride_s: float = 0.0):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._last: dict[str, Future] = {}  # owner -> its last queued command
        # Reentrant: a future already done runs its callback (`_done`) at once, under the lock.
        self._lock = threading.RLock()
        self.ride_s = ride_s
        # owner -> commands that may still ride its next request, and the timer that sends them
        self._riding: dict[str, list[tuple[Command, Callable[[], object], str]]] = {}
        self._timers: dict[str, threading.Timer] = {}
        self.sent = 0  # commands sent as requests of their own
        self.rode = 0  # commands that rode a step

    def submit(self, owner: str, fn: Callable[[], object], what: str, command: Optional[Command] = None) -> None:
        """Queue `fn` (it sends the command) after what is queued for `owner`.
        With `command` and `ride_s` > 0, it may ride the owner's next request
        instead (`take`)."""
        with self._lock:
            if command is not None and self.ride_s > 0:
                self._riding.setdefault(owner, []).append((command, fn, what))
                if owner not in self._timers:
                    timer = threading.Timer(self.ride_s, self.flush, (owner,))
                    timer.daemon = True
                    self._timers[owner] = timer
                    timer.start()
                return
            self._flush_locked(owner)  # what waits to ride goes first, in order
            self._queue_locked(owner, fn, what)

    def _queue_locked(self, owner: str, fn: Callable[[], object], what: str) -> None:
        before = self._last.get(owner)
        future = self._pool.submit(self._run, before, fn, owner, what)
        self._last[owner] = future
        future.add_done_callback(lambda f: self._done(owner, f))

    def _flush_locked(self, owner: str) -> None:
        timer = self._timers.pop(owner, None)
        if timer is not None:
            timer.cancel()
        for _, fn, what in self._riding.pop(owner, ()):
            self._queue_locked(owner, fn, what)

    def flush(self, owner: str) -> None:
        """Send what waits to ride `owner`'s next request, each on its own (the timer's end)."""
        with self._lock:
            self._flush_locked(owner)

    def take(self, owner: str) -> list[Command]:
        """The commands waiting to ride `owner`'s next request, handed to it: the
        caller puts them in that request, or `resend`s them if it fails."""
        with self._lock:
            timer = self._timers.pop(owner, None)
            if timer is not None:
                timer.cancel()
            riding = self._riding.pop(owner, [])
        self.rode += len(riding)
        return [command for command, _, _ in riding]

    def resend(self, owner: str, commands: list[Command], send: Callable[[str, dict], object]) -> None:
        """Commands a failed request took: sent on their own, first (each is
        idempotent: it holds the chain where it already is, or marks it again)."""
        with self._lock:
            for name, args in commands:
                self._queue_locked(owner, lambda n=name, a=args: send(n, a), f"the {name} its step took")

    def _run(self, before: Optional[Future], fn: Callable[[], object], owner: str, what: str) -> object:
        if before is not None:
            wait([before])
        self.sent += 1
        try:
            return fn()
        except Exception as exc:  # the step it follows has answered: log, never raise into the pool
            logger.warning("%s of %s failed after its step: %s", what, owner, exc)
            return None

    def _done(self, owner: str, future: Future) -> None:
        with self._lock:
            if self._last.get(owner) is future:
                del self._last[owner]

    def settle(self, owner: Optional[str] = None, timeout_s: float = 120.0) -> None:
        """Wait until what is queued for `owner` (None: for everyone) has been
        sent; what waits to ride is sent now."""
        with self._lock:
            for o in (list(self._riding) if owner is None else [owner]):
                self._flush_locked(o)
            futures = list(self._last.values()) if owner is None else [f for f in (self._last.get(owner),) if f]
        if futures:
            wait(futures, timeout=timeout_s)

    def close(self) -> None:
        """Shutting down: what has not started is dropped (the chains' lease
        returns them to the LRU if this runtime does not come back)."""
        with self._lock:
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
            self._riding.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
