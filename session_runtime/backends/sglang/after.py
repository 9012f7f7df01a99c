"""What the tree does after a step, off the step's path, in order per conversation.

A turn's close (hold the chain at the fork, free the branch past it, mark it
idle) and the start of a tool wait are commands the runtime can send only once
it has parsed the step's output. They wait here, after the step has answered
its client, so a step costs one request to the server:

- for up to `ride_s` they may ride the conversation's next request (its next
  step, or its canonical branch): `take` hands them to that request, whose
  `kv_hints` carry them and whose intake runs them first, in order, on every
  rank; an agent that steps again at once pays no round trip for its close;
- what no request took within `ride_s` leaves together, every conversation's
  in one `batch` command request (`send_batch`), so conversations that never
  step again (one-shot agents, a turn that ends a task) cost one round trip
  per `ride_s`, not one each; `settle` sends what waits at once, and without
  `send_batch` each goes as a command request of its own.

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
    def __init__(self, workers: int = 4, name: str = "sglang-after", ride_s: float = 0.0,
                 send_batch: Optional[Callable[[list[Command]], list]] = None):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._last: dict[str, Future] = {}  # owner -> its last queued command
        # Reentrant: a future already done runs its callback (`_done`) at once, under it.
        self._lock = threading.RLock()
        self.ride_s = ride_s
        self._send_batch = send_batch
        # owner -> commands that may still ride its next request, each (command, fn, what)
        self._riding: dict[str, list[tuple[Command, Callable[[], object], str]]] = {}
        self._timer: Optional[threading.Timer] = None  # sends what waits to ride, after ride_s
        self.sent = 0  # requests sent for commands (a batch is one)
        self.rode = 0  # commands that rode a step
        self.batched = 0  # commands sent inside a batch

    def submit(self, owner: str, fn: Callable[[], object], what: str, command: Optional[Command] = None) -> None:
        """Queue `fn` (it sends the command) after what is queued for `owner`.
        With `command` and `ride_s` > 0, it may ride the owner's next request
        instead (`take`), or leave in the next batch."""
        with self._lock:
            if command is not None and self.ride_s > 0:
                self._riding.setdefault(owner, []).append((command, fn, what))
                if self._timer is None:
                    self._timer = threading.Timer(self.ride_s, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._flush_owner(owner)  # what waits to ride goes first, in order
            self._queue(owner, fn, what)

    def _queue(self, owner: str, fn: Callable[[], object], what: str) -> None:
        before = self._last.get(owner)
        future = self._pool.submit(self._run, before, fn, owner, what)
        self._last[owner] = future
        future.add_done_callback(lambda f: self._done(owner, f))

    def _flush_owner(self, owner: str) -> None:
        for _, fn, what in self._riding.pop(owner, ()):
            self._queue(owner, fn, what)

    def flush(self) -> None:
        """Send everything that waits to ride: one batch request (or each on its own)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            riding, self._riding = self._riding, {}
            if self._send_batch is None or sum(map(len, riding.values())) < 2:
                for owner, items in riding.items():
                    self._riding[owner] = items
                    self._flush_owner(owner)
                return
            before = [f for f in (self._last.get(owner) for owner in riding) if f is not None]
            commands = [(owner, command) for owner, items in riding.items() for command, _, _ in items]
            future = self._pool.submit(self._run_batch, before, commands)
            for owner in riding:
                self._last[owner] = future
                future.add_done_callback(lambda f, o=owner: self._done(o, f))

    def take(self, owner: str) -> list[Command]:
        """The commands waiting to ride `owner`'s next request, handed to it: the
        caller puts them in that request, or `resend`s them if it fails."""
        with self._lock:
            riding = self._riding.pop(owner, [])
        self.rode += len(riding)
        return [command for command, _, _ in riding]

    def resend(self, owner: str, commands: list[Command], send: Callable[[str, dict], object]) -> None:
        """Commands a failed request took: sent on their own, first (each is
        idempotent: it holds the chain where it already is, or marks it again)."""
        with self._lock:
            for name, args in commands:
                self._queue(owner, lambda n=name, a=args: send(n, a), f"the {name} its step took")

    def _run(self, before: Optional[Future], fn: Callable[[], object], owner: str, what: str) -> object:
        if before is not None:
            wait([before])
        self.sent += 1
        try:
            return fn()
        except Exception as exc:  # the step it follows has answered: log, never raise into the pool
            logger.warning("%s of %s failed after its step: %s", what, owner, exc)
            return None

    def _run_batch(self, before: list[Future], commands: list[tuple[str, Command]]) -> object:
        if before:
            wait(before)
        self.sent += 1
        self.batched += len(commands)
        try:
            answers = self._send_batch([command for _, command in commands])
        except Exception as exc:  # as _run: logged; each chain's lease still bounds what it holds
            logger.warning("a batch of %d commands after their steps failed: %s", len(commands), exc)
            return None
        for (owner, (name, _)), got in zip(commands, answers or ()):
            if not (isinstance(got, dict) and got.get("ok")):
                logger.warning("the %s of %s failed after its step: %s", name, owner,
                               got.get("error") if isinstance(got, dict) else got)
        return answers

    def _done(self, owner: str, future: Future) -> None:
        with self._lock:
            if self._last.get(owner) is future:
                del self._last[owner]

    def settle(self, owner: Optional[str] = None, timeout_s: float = 120.0) -> None:
        """Wait until what is queued for `owner` (None: for everyone) has been
        sent; what waits to ride is sent now."""
        with self._lock:
            if owner is None:
                self.flush()
            else:
                self._flush_owner(owner)
            futures = list(self._last.values()) if owner is None else [f for f in (self._last.get(owner),) if f]
        if futures:
            wait(futures, timeout=timeout_s)

    def close(self) -> None:
        """Shutting down: what has not started is dropped (the chains' lease
        returns them to the LRU if this runtime does not come back)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._riding.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
