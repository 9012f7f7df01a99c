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
from typing import Mapping, Optional

from session_runtime.errors import InvalidRequest

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
