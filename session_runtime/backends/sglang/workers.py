"""Many SGLang workers behind one runtime: conversation affinity and failover.

A conversation's chain lives in one worker's radix tree, so each conversation
is placed on one worker when it is created (`placement.place`: consistent
hashing with bounded loads over the live workers that are not draining) and
every step and control command for it goes there. The placement is kept with
the conversation (`Conversation.worker`) and restored after a restart.

Workers are health-checked every `health_interval_s`, all at once (a hung one
holds up none of the others), and by any request that finds one unreachable.
A worker is down when
- a launched one's server process, or one of its scheduler and detokenizer
  processes, has exited (SGLang's HTTP side lives on without its scheduler and
  answers nothing): it is seen at once, and the worker is started again;
- its scheduler does not answer a ping within `probe_timeout_s` and it sent
  nothing meanwhile (a worker busy with a long step streams chunks; a hung
  one, that accepts connections and never answers, sends nothing). The ping is
  a command through SGLang's request path, answered at the scheduler's intake
  (milliseconds); SGLang's own `/health` generates a token and polls for it
  each second, so it takes at least 1 s and is not used.
Steps in flight on a worker found down are closed (`abandon`): they fail with
the worker's retryable 503 at once and change nothing. The next request of a
conversation whose worker is down, or draining, moves it to a live worker: the
KV is rebuilt there by prefill (its accounting counts the history as
recomputed, `backend_lost`), and nothing acknowledged is lost because history
lives in the runtime, not in the worker. A worker that answers again (restarted,
or given by URL and back) rejoins: new conversations may be placed on it; the
ones that moved off it stay where they went.

Stateless steps (a throw-away conversation, placed with `stateless=True`) go
through `sglang-router` when the pool has one (`router.py`): it picks the
worker whose cache holds their prefix. Without a router, or while it is down,
they are placed like any conversation.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from radix_ext.tree import Namespace, NodeInfo, ProbeResult
from session_runtime import placement
from session_runtime.backends.base import Backend, ChainState, StepRequest, StepResult
from session_runtime.backends.sglang.backend import SGLangBackend
from session_runtime.backends.sglang.router import RoutedBackend, unfold
from session_runtime.errors import BackendUnavailable, InvalidRequest
from session_runtime.metrics import Sample, counter, gauge

logger = logging.getLogger(__name__)


class WorkerPool(Backend):
    name = "sglang"
    supports_offload = True
    probes_in_step = True  # every worker's are (a stateless step's router's are not: route() says)

    def __init__(self, workers: dict[str, SGLangBackend], epsilon: float = 0.25, health_interval_s: float = 0.5,
                 router: Optional[RoutedBackend] = None, probe_timeout_s: float = 2.0):
        if not workers:
            raise InvalidRequest("no SGLang worker")
        first = next(iter(workers.values()))
        for wid, w in workers.items():
            if (w.page_size, w.bytes_per_token) != (first.page_size, first.bytes_per_token):
                raise InvalidRequest(f"worker {wid} has page size {w.page_size} and {w.bytes_per_token} KV bytes "
                                     f"per token; worker {next(iter(workers))} has {first.page_size} and "
                                     f"{first.bytes_per_token}: the workers must serve the same model alike")
        self.workers = workers
        self.epsilon = epsilon
        self.page_size, self.bytes_per_token = first.page_size, first.bytes_per_token
        self.capacity = min(w.capacity for w in workers.values())  # what one step can use
        self.vocab_size = min(w.vocab_size for w in workers.values())
        self.max_context = min(w.max_context for w in workers.values())
        self.where: dict[str, str] = {}  # conversation -> worker
        self.router = router
        self.stateless: set[str] = set()  # throw-away conversations: routed by the router while it is up
        self.up = {wid: True for wid in workers}
        self.draining: set[str] = set()
        self.moves = 0  # conversations moved off a dead or draining worker
        self._stale: dict[str, set[str]] = {}  # worker -> conversations moved off it while it was down
        self._ring = placement.ring(sorted(workers))
        self.probe_timeout_s = probe_timeout_s
        self._probes = ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="sglang-probe")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._health = threading.Thread(target=self._watch, args=(health_interval_s,), name="sglang-health",
                                        daemon=True)
        self._health.start()

    # ----- placement ----------------------------------------------------------

    def place(self, owner: str, worker: Optional[str] = None, stateless: bool = False) -> Optional[str]:
        """The conversation's worker: `worker` (a restored placement) while it is
        live and not draining, else a fresh placement. A stateless one has none
        while the router is up (None): the router picks one for each step."""
        with self._lock:
            if stateless and self.router is not None:
                self.stateless.add(owner)
                if self.router.available():
                    return None
            if worker is not None and self._usable(worker):
                self.where[owner] = worker
                return worker
            return self._place_locked(owner)

    def worker_of(self, owner: str) -> Optional[str]:
        with self._lock:
            return self.where.get(owner)

    def forget(self, owner: str) -> None:
        with self._lock:
            self.where.pop(owner, None)
            self.stateless.discard(owner)

    def _usable(self, wid: str) -> bool:
        return wid in self.workers and self.up[wid] and wid not in self.draining

    def _loads(self) -> dict[str, int]:
        loads = {wid: 0 for wid in self.workers if self._usable(wid)}
        for wid in self.where.values():
            if wid in loads:
                loads[wid] += 1
        return loads

    def _place_locked(self, owner: str) -> str:
        loads = self._loads()
        if not loads:
            raise BackendUnavailable("no SGLang worker is up (every one is down or draining); nothing changed, "
                                     "retry once one is back")
        self.where.pop(owner, None)
        self.where[owner] = wid = placement.place(owner, loads, self.epsilon, self._ring)
        return wid

    def _of(self, owner: str) -> SGLangBackend:
        """The owner's worker (a stateless owner's: the router while it is up);
        one that is down or draining hands it to a live one."""
        with self._lock:
            if owner in self.stateless and owner not in self.where and self.router.available():
                return self.router
            wid = self.where.get(owner)
            if wid is None or not self._usable(wid):
                old = wid
                wid = self._place_locked(owner)
                if old is not None:
                    self.moves += 1
                    if not self.up.get(old, False):
                        self._stale.setdefault(old, set()).add(owner)  # released there when it is back
                    logger.warning("conversation %s moves from worker %s (%s) to %s; its next step prefills", owner,
                                   old, "draining" if old in self.draining else "down", wid)
            return self.workers[wid]

    def _any(self) -> SGLangBackend:
        with self._lock:
            live = [w for wid, w in self.workers.items() if self.up[wid]]
        if not live:
            raise BackendUnavailable("no SGLang worker is up; nothing changed, retry once one is back")
        return live[0]

    def _mark(self, worker: SGLangBackend, exc: BaseException) -> None:
        if worker is self.router:
            logger.error("sglang-router at %s failed a stateless step: %s", worker.url, exc)
            return
        wid = next(k for k, w in self.workers.items() if w is worker)
        with self._lock:
            was, self.up[wid] = self.up[wid], False
        if was:
            logger.error("SGLang worker %s is down: %s", wid, exc)

    def _call(self, owner: str, fn: Callable[[SGLangBackend], object]):
        worker = self._of(owner)
        try:
            return fn(worker)
        except BackendUnavailable as exc:
            self._mark(worker, exc)
            raise

    # ----- health and drain ---------------------------------------------------

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.check_health()
            except Exception:  # the checks go on: a worker's state is read again next time
                if self._stop.is_set():
                    return  # its probes' threads shut down: the pool is closing
                logger.exception("checking the SGLang workers' health failed")

    def check_health(self) -> dict[str, bool]:
        """Probe every worker at once. One that answers again rejoins; one
        found down has the steps open on it closed (they fail retryably at
        once), and a launched one whose processes died is started again."""
        for wid, ok in zip(self.workers, self._probes.map(self._healthy, self.workers.values())):
            w = self.workers[wid]
            with self._lock:
                was, self.up[wid] = self.up[wid], ok
            if ok and not was:
                logger.warning("SGLang worker %s is back: new conversations may be placed on it", wid)
                with self._lock:
                    stale = self._stale.pop(wid, set())
                for owner in stale:  # their chains moved on; what it still holds of them goes
                    w.release(owner)
            elif not ok:
                if w.abandon() or was:
                    logger.error("SGLang worker %s is down (no answer to a ping within %.1f s, or its processes "
                                 "exited); its conversations move on their next steps", wid, self.probe_timeout_s)
        with self._lock:
            return dict(self.up)

    def _healthy(self, w: SGLangBackend) -> bool:
        if w.revive() or not w.available():  # a launched one that died starts again
            return False
        asked = time.monotonic()
        return w.answers(self.probe_timeout_s) or w.last_answer > asked  # busy: it streams meanwhile

    def drain(self, wid: str) -> list[str]:
        """Stop placing on `wid` and hand its conversations to the other workers
        now (their chains there are released). Returns the conversations moved."""
        if wid not in self.workers:
            raise KeyError(wid)
        with self._lock:
            self.draining.add(wid)
            owners = [o for o, w in self.where.items() if w == wid]
            if owners and not self._loads():
                self.draining.discard(wid)
                raise BackendUnavailable(f"worker {wid} cannot drain: no other worker is up to take its "
                                         f"{len(owners)} conversations")
        for owner in owners:
            try:
                self.workers[wid].release(owner)
            except BackendUnavailable:
                pass  # a worker that is gone holds nothing
            self._of(owner)
        return owners

    def undrain(self, wid: str) -> None:
        if wid not in self.workers:
            raise KeyError(wid)
        with self._lock:
            self.draining.discard(wid)

    def describe_workers(self) -> list[dict]:
        with self._lock:
            loads = {wid: 0 for wid in self.workers}
            for wid in self.where.values():
                loads[wid] = loads.get(wid, 0) + 1
            return [{"id": wid, "url": w.url, "up": self.up[wid], "draining": wid in self.draining,
                     "conversations": loads[wid], "launched": w.server is not None}
                    for wid, w in self.workers.items()]

    # ----- the Backend interface, routed ----------------------------------------

    def step(self, req: StepRequest) -> StepResult:
        return self._call(req.owner, lambda w: w.step(req))

    def route(self, owner: str) -> SGLangBackend:
        return self._of(owner)

    def probe(self, namespace: Namespace, tokens: Sequence[int]) -> ProbeResult:
        return self._any().probe(namespace, tokens)  # a conversation's own probes go through route()

    def probe_many(self, namespace: Namespace, prompts: Sequence[Sequence[int]]) -> list[ProbeResult]:
        return self._any().probe_many(namespace, prompts)

    def lock_prefix(self, owner: str, namespace: Namespace, tokens: Sequence[int], free_branch: bool = False) -> int:
        return self._call(owner, lambda w: w.lock_prefix(owner, namespace, tokens, free_branch))

    def close_turn(self, owner: str, namespace: Namespace, fork: Optional[Sequence[int]], free_branch: bool,
                   idle_ttl_s: Optional[float]) -> Optional[ChainState]:
        return self._call(owner, lambda w: w.close_turn(owner, namespace, fork, free_branch, idle_ttl_s))

    def mark_idle(self, owner: str, ttl_s: float) -> None:
        self._quiet(owner, lambda w: w.mark_idle(owner, ttl_s))

    def release(self, owner: str) -> None:
        wid = self.worker_of(owner)
        if wid is not None:
            self.workers[wid].release(owner)  # quiet when the worker is gone
        self.forget(owner)

    def chain_tokens(self, owner: str) -> int:
        wid = self.worker_of(owner)
        if wid is None or not self.up[wid]:
            return 0
        try:
            return self.workers[wid].chain_tokens(owner)
        except BackendUnavailable:
            return 0

    def chain_lengths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for wid, w in self._live():
            out.update(w.chain_lengths())
        return out

    def snapshot(self, preview: Callable[[Sequence[int]], str], owner: Optional[str] = None,
                 worker: Optional[str] = None) -> list[NodeInfo]:
        """One worker's tree (`worker`, or the owner's), or every live worker's
        one after another (node ids are per worker)."""
        if worker is None and owner is not None:
            worker = self.worker_of(owner)
        if worker is not None:
            if worker not in self.workers:
                raise KeyError(worker)
            return [unfold(n) for n in self.workers[worker].snapshot(preview, owner)]
        return [unfold(n) for _, w in self._live() for n in w.snapshot(preview, owner)]

    def metric_samples(self) -> list[Sample]:
        """Each live worker's figures with a `worker` label (one control round
        trip per worker), and the pool's own. No unlabelled total beside them:
        `sum()` over the family would count it twice; sum the workers instead."""
        samples: list[Sample] = []
        for wid, w in self._live():
            try:
                samples += [s.labelled(worker=wid) for s in w.metric_samples()]
            except BackendUnavailable as exc:  # the others' figures still count
                self._mark(w, exc)
        with self._lock:
            up, draining, moves = sum(self.up.values()), len(self.draining), self.moves
        return [
            *samples,
            gauge("sglang_workers_up", up, "SGLang workers that answer"),
            gauge("sglang_workers_draining", draining, "SGLang workers being drained"),
            counter("sglang_conversations_moved_total", moves, "Conversations moved off a dead or draining worker"),
            *([] if self.router is None else [
                gauge("sglang_router_up", int(self.router.available()),
                      "sglang-router runs (its process; always 1 for one given by --router-url)"),
                counter("sglang_router_steps_total", self.router.steps, "Stateless steps sent through sglang-router"),
            ]),
        ]

    def free_fraction(self) -> float:
        live = self._live()
        return max((w.free_fraction() for _, w in live), default=0.0)

    def check_integrity(self) -> None:
        self.integrity()

    def integrity(self) -> dict:
        return {"workers": {wid: w.integrity() for wid, w in self._live()}}

    def available(self) -> bool:
        with self._lock:
            return any(self.up.values())

    def adopt(self, owners: Sequence[str], release_others: bool = True) -> None:
        for wid, w in self._live():
            try:
                w.adopt(owners, release_others)
            except BackendUnavailable as exc:
                self._mark(w, exc)

    def make_offload(self, background: bool = True, idle_ttl_s: float = 0.0):
        # Idle chains are the scheduler's to retire (mark_idle): idle_ttl_s travels with each close.
        from session_runtime.backends.sglang.offload import SchedulerOffload

        return SchedulerOffload(self, background=background)

    def expect_host(self, owner: str) -> None:
        self._quiet(owner, lambda w: w.expect_host(owner))

    def mark_waiting(self, owner: str) -> None:
        self._call(owner, lambda w: w.mark_waiting(owner))

    def demote(self, owner: str, copy: bool = True) -> int:
        return self._call(owner, lambda w: w.demote(owner, copy))

    def drop_host_copy(self, owner: str) -> None:
        self._quiet(owner, lambda w: w.drop_host_copy(owner))

    def host_bytes(self, owner: str) -> int:
        wid = self.worker_of(owner)
        return 0 if wid is None or not self.up[wid] else self.workers[wid].host_bytes(owner)

    def pools(self) -> dict:
        return {wid: w.pools() for wid, w in self._live()}

    def describe(self) -> str:
        router = f"; {self.router.describe()}" if self.router is not None else ""
        return f"{len(self.workers)} SGLang workers: " + "; ".join(
            f"{wid}: {w.describe()}" for wid, w in self.workers.items()) + router

    def close(self) -> None:
        self._stop.set()
        self._probes.shutdown(wait=False)
        if self.router is not None:
            self.router.close()
        for w in self.workers.values():
            w.close()

    def _live(self) -> list[tuple[str, SGLangBackend]]:
        with self._lock:
            return [(wid, w) for wid, w in self.workers.items() if self.up[wid]]

    def _quiet(self, owner: str, fn) -> None:
        try:
            self._call(owner, fn)
        except BackendUnavailable:
            pass  # a worker that is gone holds nothing to mark
