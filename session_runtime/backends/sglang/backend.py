"""The SGLang backend: SGLang's own server computes every step, batched, and
its scheduler holds the conversations' chains in `radix_ext`'s `session`
radix-cache backend.

A step is one `/generate` with our template's token ids, the conversation id
as `session_id` and, in `kv_hints`, everything the tree does for the step (the
counterfactual probes, promotion from the host tier, hold the new tail); the
server streams output ids back, and the tree's report (what it probed,
promoted and holds now) comes back in the final `meta_info`. A step makes no
other call. Forced output (replay) is prefilled as part of the input with no
new tokens, so its KV lands in the chain as if generated. What has no request
of its own (a turn's fork point, a release, a snapshot, an integrity check)
is a command request (`control_client.py`). Requests on different
conversations run concurrently here: SGLang batches them.

Its parts, each in its module: generate.py (a step as the wire carries it:
the body out, the result and accounting in), streams.py (the step streams
open on the server, and hanging them all up), keeper.py (a launched server
kept running, and what its errors mean), after.py (commands after a step,
riding the next request).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Optional, Sequence

import httpx

from radix_ext.sglang.control import ChannelDown, ControlError
from radix_ext.sglang.hints import ChainIntent
from radix_ext.tree import Namespace, NodeInfo, ProbeResult
from session_runtime.backends.base import Backend, StepRequest, StepResult
from session_runtime.backends.sglang.after import OwnerQueue
from session_runtime.backends.sglang.control_client import RequestControl
from session_runtime.backends.sglang.keeper import ServerKeeper
from session_runtime.backends.sglang.streams import StepStreams
from session_runtime.backends.sglang.generate import Timings, check_prompt, relative, request_body, step_result
from session_runtime.direct_http import DirectPool
from session_runtime.errors import BackendUnavailable, InvalidRequest
from session_runtime.metrics import Sample, gauge

logger = logging.getLogger(__name__)

# How long a turn's close (or a tool wait's start) may wait to ride the
# conversation's next request before it leaves in one batch with every other
# conversation's (after.py): an agent that steps again within it pays no round
# trip for it; the close is off the step's path either way.
RIDE_S = 0.5


class SGLangBackend(Backend):
    """Talks to one SGLang server (launched by us or given by URL)."""

    name = "sglang"
    supports_offload = True  # inside the scheduler: radix_ext/sglang/offload.py
    probes_in_step = True  # the counterfactual probes ride the step's request

    def __init__(self, url: str, control: Optional[RequestControl], *, page_size: int, capacity: int,
                 bytes_per_token: int, vocab_size: int, max_context: int, server=None, host_tokens: int = 0,
                 tp_size: int = 1, http: Optional[httpx.Client] = None, lease_s: float = 0.0,
                 constrains: bool = True):
        self.url = url.rstrip("/")
        self.constrains = constrains  # the server has a tokenizer: grammars and stop sequences
        self.host_tokens = host_tokens  # the scheduler's host tier, allocated when this runtime connects (adopt)
        self._maybe_on_host: set[str] = set()  # owners a tool wait or idle retirement may have demoted
        self.control = control
        self.tp_size = tp_size
        self.holder = uuid.uuid4().hex  # this runtime process, for the chains' lease
        self.lease_s = lease_s
        self.renewals = 0
        self.waited_commands = 0  # commands a caller waited for (none on a step's path)
        self.page_size = page_size
        self.capacity = capacity
        self.bytes_per_token = bytes_per_token
        self.vocab_size = vocab_size
        self.max_context = max_context
        # Commands run on these threads; their callers wait for the answer or for
        # `abandon`, whichever comes first (a hung server's answer never comes).
        self._commands = ThreadPoolExecutor(max_workers=32, thread_name_prefix="sglang-command")
        self.http = http if http is not None else control.http  # commands and checks
        # A step's own request: lean keep-alive connections, with the same key (direct_http.py)
        self.step_http = DirectPool(self.url, headers={k: v for k, v in self.http.headers.items()
                                                   if k.lower() == "authorization"},
                                timeout_s=self.http.timeout.read or 600.0)
        # Commands after a step, off its path, in order per conversation; for up to
        # RIDE_S they may ride the conversation's next request instead of their own.
        self.after = OwnerQueue(ride_s=RIDE_S, send_batch=lambda commands: self._send(
            "batch", commands=[{"cmd": name, "args": args} for name, args in commands]))
        self._stop = threading.Event()
        self._heartbeat = None
        if lease_s > 0 and control is not None:
            self._heartbeat = threading.Thread(target=self._renew, name="sglang-lease", daemon=True)
            self._heartbeat.start()
        # A launched server's death is seen within a second, step or no step, and it is started again.
        self.keeper = ServerKeeper(server, self.url, self.abandon, self._stop)
        self.streams = StepStreams(self.step_http, self.keeper)  # and `abandon` hangs them up

    # ----- steps --------------------------------------------------------------

    def step(self, req: StepRequest) -> StepResult:
        # The previous step's close or tool wait rides this request (its intake runs
        # them first), or, already sent, is in the tree first.
        riding = self.after.take(req.owner)
        try:
            self.after.settle(req.owner)
            return self._step(req, riding)
        except BaseException:
            if riding:  # perhaps never reached the server: sent on their own (idempotent)
                self.after.resend(req.owner, riding, lambda name, args: self._send(name, **args))
            raise

    def _step(self, req: StepRequest, riding: list) -> StepResult:
        self.keeper.check()
        t0 = time.perf_counter()
        prompt = list(req.prompt)
        forced = None if req.forced is None else list(req.forced)
        check_prompt(prompt, forced, self.max_context, self.vocab_size, self.capacity)
        n = len(prompt)
        # A tool wait or idle retirement may have demoted this chain, or another
        # conversation's whose host copy this prompt continues (shared).
        promote = bool(self._maybe_on_host)
        body = self._body(req, prompt, forced, promote, riding)
        chunks = self.streams.post(body, req.cancel)
        first_t = last_t = None
        output: list[int] = []
        final: dict = {}
        try:
            for chunk in chunks:
                if req.cancel is not None:
                    req.cancel.check()  # leaving the stream closes it: SGLang aborts the request
                now = time.perf_counter()
                ids = chunk.get("output_ids") or []
                if first_t is None and (ids or forced is not None):
                    first_t = now
                    if req.on_prefill is not None:  # SGLang's meta_info has the prefix match from the first chunk on
                        req.on_prefill(n, min(int((chunk.get("meta_info") or {}).get("cached_tokens") or 0), n))
                for tok in ids[len(output):]:
                    if req.on_token is not None and forced is None:
                        req.on_token(tok)
                if len(ids) > len(output):
                    last_t = now
                output = list(ids)
                final = chunk
        finally:
            chunks.close()  # at once: a cancelled step closes its stream and SGLang aborts it
        meta = final.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        if not final or reason.get("type") == "abort":
            raise self.keeper.abort_error(reason.get("message") if reason else "the stream ended without a result")
        end_t = time.perf_counter()
        result, report = step_result(req, prompt, forced, meta, output, riding, Timings(t0, first_t, last_t, end_t),
                                     self.page_size, self.bytes_per_token)
        if promote and not report.get("on_host", True):
            self._maybe_on_host.discard(req.owner)
        return result

    def _body(self, req: StepRequest, prompt: list[int], forced: Optional[list[int]], promote: bool,
              riding: Sequence = ()) -> dict:
        if forced is None and req.sampling.constrained and not self.constrains:
            raise InvalidRequest(f"the SGLang server at {self.url} runs with --skip-tokenizer-init, so it cannot "
                                 "force a tool, follow a JSON schema or match stop sequences; start it with its "
                                 "tokenizer and --grammar-backend xgrammar")
        return request_body(req, prompt, forced, ChainIntent(
            hold=req.hold_chain, cache_limit=None if req.cache_output else len(prompt), promote=promote,
            share=promote, probes=tuple(relative(p, prompt) for p in req.probe_prompts),
            holder=self.holder if self.lease_s > 0 else None, lease_s=self.lease_s, before=tuple(riding)),
            self.max_context)

    def answers(self, timeout_s: float) -> bool:
        """Whether its scheduler answers a ping within `timeout_s`, through
        SGLang's request path as a step goes (HTTP, tokenizer, scheduler and
        back; answered at intake, so in milliseconds when it serves, between
        two batches when it is busy). A refusal is an answer."""
        try:
            self.control.call("ping", timeout_s=timeout_s)
        except ChannelDown:
            return False
        except ControlError:
            pass
        self.streams.last_answer = time.monotonic()
        return True

    @property
    def last_answer(self) -> float:
        """When the server last sent anything (a chunk, a command's answer)."""
        return self.streams.last_answer

    def abandon(self) -> int:
        """The server stopped answering (hung, or its processes died): close
        every step stream open on it, and stop waiting for the commands sent
        to it, so those fail at once with the retryable BackendUnavailable
        (streams.py). Returns how many steps were open."""
        return self.streams.abandon()

    # ----- a launched server that dies is started again (keeper.py) -------------

    @property
    def server(self):
        """The LaunchedServer this backend started, or None (--sglang-url)."""
        return self.keeper.server

    def available(self) -> bool:
        return self.keeper.available()

    def revive(self) -> bool:
        return self.keeper.revive()

    # ----- the tree, by command requests ---------------------------------------

    def _call(self, name: str, **args):
        """A command, after what is queued for after earlier steps (`after.py`);
        the caller waits for it (`waited_commands` counts them)."""
        self.after.settle()
        self.waited_commands += 1
        return self._send(name, **args)

    def _send(self, name: str, **args):
        self.keeper.check()
        gone = self.streams.gone()
        try:
            command = self._commands.submit(self.control.call, name, **args)
        except RuntimeError:  # its threads are shut down
            raise BackendUnavailable(f"the runtime closed its connection to SGLang at {self.url}") from None
        wait((command, gone), return_when=FIRST_COMPLETED)
        if not command.done():
            raise BackendUnavailable(self.keeper.down(f"it stopped answering; the {name!r} command is not awaited"))
        try:
            answer = command.result()
        except ChannelDown as exc:
            raise BackendUnavailable(self.keeper.down(exc.message)) from None
        self.streams.last_answer = time.monotonic()
        return answer

    def probe(self, namespace: Namespace, tokens: Sequence[int]) -> ProbeResult:
        tokens = list(tokens)[: max(len(tokens) - 1, 0)]
        got = self._call("probe", tokens=tokens, **_ns(namespace))
        return ProbeResult(logical_len=got["logical_len"], device_len=got["device_len"])

    def probe_many(self, namespace: Namespace, prompts: Sequence[Sequence[int]]) -> list[ProbeResult]:
        got = self._call("probe_many", prompts=[list(p)[: max(len(p) - 1, 0)] for p in prompts], **_ns(namespace))
        return [ProbeResult(logical_len=g["logical_len"], device_len=g["device_len"]) for g in got]

    def lock_prefix(self, owner: str, namespace: Namespace, tokens: Sequence[int], free_branch: bool = False) -> int:
        return self._call("hold_prefix", owner=owner, tokens=list(tokens), free_branch=free_branch,
                          **_ns(namespace))["tokens"]

    def close_turn(self, owner: str, namespace: Namespace, fork: Optional[Sequence[int]], free_branch: bool,
                   idle_ttl_s: Optional[float]) -> None:
        """One command, sent after the step has answered (`after.py`): hold the
        chain at the fork, free the branch past it, mark it idle. Returns None:
        the step's own report says what the chain will hold."""
        if idle_ttl_s is not None:
            self._maybe_on_host.add(owner)  # retiring it may demote it: the next step promotes it
        args: dict = {"owner": owner, "free_branch": free_branch, "host_tokens": self.host_tokens, **_ns(namespace)}
        if fork is not None:
            args["tokens"] = list(fork)
        if idle_ttl_s is not None:
            args["ttl_s"] = idle_ttl_s
        self.after.submit(owner, lambda: self._send("close", **args), "the turn's close", ("close", args))

    # ----- leases -----------------------------------------------------------------

    def _renew(self) -> None:
        """Heartbeat: every chain this runtime holds keeps its lease while it lives
        (a tool wait can outlast any step)."""
        while not self._stop.wait(max(0.2, self.lease_s / 3)):
            try:
                self.renewals += 1
                self._send("renew", holder=self.holder, lease_s=self.lease_s)
            except (BackendUnavailable, ControlError) as exc:
                logger.warning("renewing the chains' lease on %s failed: %s", self.url, exc)

    def adopt(self, owners: Sequence[str], release_others: bool = True) -> None:
        """At start: the chains of `owners` are this runtime's now; the server
        releases every other chain (a dead runtime's, or a deleted conversation's)
        unless `release_others` is False. The scheduler's host arena is
        allocated now, at the size this runtime gives it, not inside a later
        command."""
        got = self._call("adopt", holder=self.holder, lease_s=self.lease_s, keep=list(owners),
                         release=release_others, host_tokens=self.host_tokens)
        if got["released"]:
            logger.warning("released %d chains on %s that no conversation of this runtime owns",
                           got["released"], self.url)

    # ----- tool-wait offload (the copies run in the scheduler) ---------------------

    def make_offload(self, background: bool = True, idle_ttl_s: float = 0.0):
        # Idle chains are the scheduler's to retire (mark_idle): idle_ttl_s travels with each close.
        from session_runtime.backends.sglang.offload import SchedulerOffload

        return SchedulerOffload(self, background=background)

    def expect_host(self, owner: str) -> None:
        self._maybe_on_host.add(owner)

    def mark_waiting(self, owner: str) -> None:
        """The owner waits for tools (pressure may demote it): sent after the step, in order."""
        args = {"owner": owner, "host_tokens": self.host_tokens}
        self.after.submit(owner, lambda: self._send("wait", **args), "the tool wait's start", ("wait", args))

    def demote(self, owner: str, copy: bool = True) -> int:
        self._maybe_on_host.add(owner)  # the next step promotes what moved
        return self._call("demote", owner=owner, host_tokens=self.host_tokens, copy=copy)["tokens"]

    def host_bytes(self, owner: str) -> int:
        if owner not in self._maybe_on_host:
            return 0
        try:
            return self._call("host", owner=owner)["bytes"]
        except BackendUnavailable:
            return 0

    def mark_idle(self, owner: str, ttl_s: float) -> None:
        # The scheduler retires it (radix_ext/sglang/idle.py): SGLang queues
        # what does not fit, so pressure is seen there, not here.
        self._maybe_on_host.add(owner)  # retiring it may demote it: the next step promotes it
        try:
            self._call("idle", owner=owner, ttl_s=ttl_s, host_tokens=self.host_tokens)
        except BackendUnavailable:
            pass  # a server that is gone holds no chain to retire

    def release(self, owner: str) -> None:
        try:
            self._call("release", owner=owner)
        except BackendUnavailable:
            pass  # a server that is gone holds no chain; one that restarts starts empty

    def chain_tokens(self, owner: str) -> int:
        return self.chain_lengths().get(owner, 0)

    def chain_lengths(self) -> dict[str, int]:
        return dict(self._call("pools")["chains"])

    def snapshot(self, preview: Callable[[Sequence[int]], str], owner: Optional[str] = None) -> list[NodeInfo]:
        nodes = self._call("snapshot", owner=owner)["nodes"]
        return [NodeInfo(**{**n, "preview": preview(n["preview"]), "owners": tuple(n["owners"])}) for n in nodes]

    def pools(self) -> dict:
        return self._call("pools")

    def metric_samples(self) -> list[Sample]:
        p = self.pools()
        return [
            gauge("pool_capacity_tokens", p["capacity"], "KV slots of the device pool"),
            gauge("pool_free_tokens", p["available"], "Free KV slots of the device pool"),
            gauge("tree_locked_tokens", p["protected"], "Tree tokens locked by conversations"),
            gauge("tree_evictable_tokens", p["evictable"], "Tree tokens no chain locks: evictable"),
            gauge("sglang_requests_in_scheduler", p["running"],
                  "Requests SGLang's scheduler holds: waiting, running or in its last batch"),
        ]

    def free_fraction(self) -> float:
        p = self.pools()
        return (p["available"] + p["evictable"]) / p["capacity"]

    def check_integrity(self) -> None:
        self.integrity()

    def integrity(self) -> dict:
        """The tree's check on every tensor-parallel rank (their digests compared)."""
        try:
            got = self._call("check")
        except ControlError as exc:
            raise AssertionError(f"SGLang tree: {exc}") from None
        return {"ranks": got.get("ranks", 1), "checked": got.get("checked"), "digest": got.get("digest")}

    def describe(self) -> str:
        where = f"launched in {self.server.started_s:.0f} s" if self.server is not None else "given by --sglang-url"
        return f"SGLang server at {self.url} ({where}; page size {self.page_size}, pool {self.capacity} tokens)"

    def close(self) -> None:
        self._stop.set()
        self.after.close()
        self._commands.shutdown(wait=False, cancel_futures=True)
        self.http.close()
        self.step_http.close()
        self.keeper.close()


def _ns(namespace: Namespace) -> dict:
    return {"extra_key": namespace.extra_key, "cache_salt": namespace.cache_salt}
