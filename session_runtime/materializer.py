"""Idle-time prefill of canonical branches, below every user request.

After a turn drops its reasoning, the canonical sequence C = P | A diverges
from the generated P | R | A at the fork. A job prefills C on top of P's
pages (the engine's ordinary step with no output), so the next user message
costs only its own tokens. The old answer's KV is never reused: it was
computed after R.

A user step on the same conversation first calls `claim`: a job still
pending is cancelled (the step then prefills lazily, no double work); a job
already running is joined (the step waits for it, then reuses its pages, and
never waits longer than a lazy prefill of the same tokens would take).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from radix_ext.tree import Namespace
from session_runtime.backends.base import Backend, StepRequest
from session_runtime.sampling import SamplingParams


@dataclass
class Job:
    owner: str
    tokens: list[int]
    namespace: Namespace
    state: str = "pending"  # pending, running, done, cancelled, failed
    prefill_tokens: int = 0
    error: Optional[str] = None
    done: threading.Event = field(default_factory=threading.Event)


class Materializer:
    """Runs jobs on a worker thread when no user request waits, or on demand
    (`run_pending`) when built with background=False (deterministic tests)."""

    def __init__(self, backend: Backend, background: bool = True):
        self.backend = backend
        self.jobs: dict[str, Job] = {}
        self.cond = threading.Condition()
        self.waiting_users = 0  # user requests queued for the engine
        self.before_run: Optional[Callable[[Job], None]] = None  # test hook
        self.on_done: Optional[Callable[[Job], None]] = None  # the runtime records the result
        self.stats = {"done": 0, "cancelled": 0, "joined": 0, "failed": 0, "prefill_tokens": 0}
        self._stop = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="materializer", daemon=True)
            self._thread.start()

    # ----- producer side --------------------------------------------------------

    def submit(self, owner: str, tokens: list[int], namespace: Namespace) -> Job:
        """Queue a job for `owner`, replacing any pending one."""
        job = Job(owner, tokens, namespace)
        with self.cond:
            old = self.jobs.get(owner)
            if old is not None and old.state == "pending":
                self._finish(old, "cancelled")
            self.jobs[owner] = job
            self.cond.notify_all()
        return job

    def claim(self, owner: str) -> Optional[Job]:
        """Before a user step: cancel a pending job, or wait for a running one.
        Returns the job it dealt with (None if there was none)."""
        with self.cond:
            job = self.jobs.get(owner)
            if job is None:
                return None
            if job.state == "pending":
                self._finish(job, "cancelled")
                del self.jobs[owner]
                return job
            if job.state == "running":
                self.stats["joined"] += 1
        job.done.wait()
        with self.cond:
            if self.jobs.get(owner) is job:
                del self.jobs[owner]
        return job

    def cancel(self, owner: str) -> None:
        """Forget `owner`'s job (conversation deleted); waits if it is running."""
        self.claim(owner)

    # ----- user-request accounting (priority) -----------------------------------

    def user_enter(self) -> None:
        with self.cond:
            self.waiting_users += 1

    def user_exit(self) -> None:
        with self.cond:
            self.waiting_users -= 1
            # The worker waits only for this (or a submit): wake it only when it has work to start now,
            # not after every user step (a wake-up and a GIL hand-off each).
            if self.waiting_users == 0 and self._any_pending():
                self.cond.notify_all()

    def _any_pending(self) -> bool:
        return any(j.state == "pending" for j in self.jobs.values())

    @property
    def idle(self) -> bool:
        return self.waiting_users == 0

    # ----- worker side ----------------------------------------------------------

    def run_pending(self) -> int:
        """Run every pending job now, in submission order. Returns how many ran."""
        count = 0
        while True:
            with self.cond:
                job = next((j for j in self.jobs.values() if j.state == "pending"), None)
                if job is None:
                    return count
                job.state = "running"
            self._run(job)
            count += 1

    def _loop(self) -> None:
        while True:
            with self.cond:
                # Lower priority than any user request: wait while one is queued.
                while not self._stop and (
                    self.waiting_users > 0 or not self._any_pending()
                ):
                    self.cond.wait(timeout=0.5)
                if self._stop:
                    return
                job = next(j for j in self.jobs.values() if j.state == "pending")
                job.state = "running"
            self._run(job)

    def _run(self, job: Job) -> None:
        try:
            if self.before_run is not None:
                self.before_run(job)
            result = self.backend.step(
                StepRequest(owner=job.owner, prompt=job.tokens, namespace=job.namespace,
                            sampling=SamplingParams(max_tokens=0), forced=[], background=True)
            )
            job.prefill_tokens = result.accounting.uncached_prefill_tokens
            if self.on_done is not None:
                self.on_done(job)
            with self.cond:
                self.stats["prefill_tokens"] += job.prefill_tokens
                self._finish(job, "done")
        except Exception as exc:  # the pool may be full: the next step prefills lazily
            job.error = f"{type(exc).__name__}: {exc}"
            with self.cond:
                self._finish(job, "failed")

    def _finish(self, job: Job, state: str) -> None:
        job.state = state
        self.stats[state] += 1
        job.done.set()

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no job is pending or running (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.cond:
                if not any(j.state in ("pending", "running") for j in self.jobs.values()):
                    return True
            time.sleep(0.005)
        return False
