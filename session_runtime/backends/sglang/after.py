"""What the tree does after a step, off the step's path, in order per conversation.

A turn's close (hold the chain at the fork, free the branch past it, mark it
idle) and the start of a tool wait are commands the runtime can send only once
it has parsed the step's output. They are queued here and sent by a small pool
of threads after the step has answered its client, so a step costs one request
to the server. Order is kept per conversation: a queued command waits for the
one queued before it for the same conversation, and anything that reads or
changes that conversation's chain (its next step, a canonical branch, a
release, `/debug/tree`) first waits until its queue is empty (`settle`). The
pool picks commands in the order they were queued, so a command never waits
on one queued after it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class OwnerQueue:
    def __init__(self, workers: int = 4, name: str = "sglang-after"):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._last: dict[str, Future] = {}  # owner -> its last queued command
        self._lock = threading.Lock()
        self.sent = 0

    def submit(self, owner: str, fn: Callable[[], object], what: str) -> None:
        with self._lock:
            before = self._last.get(owner)
            future = self._pool.submit(self._run, before, fn, owner, what)
            self._last[owner] = future
        future.add_done_callback(lambda f: self._done(owner, f))

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
        """Wait until what is queued for `owner` (None: for everyone) has been sent."""
        with self._lock:
            futures = list(self._last.values()) if owner is None else [f for f in (self._last.get(owner),) if f]
        if futures:
            wait(futures, timeout=timeout_s)

    def close(self) -> None:
        """Shutting down: what has not started is dropped (the chains' lease
        returns them to the LRU if this runtime does not come back)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
