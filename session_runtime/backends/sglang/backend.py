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
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Optional, Sequence

import httpx
import orjson

from radix_ext.sglang.control import ChannelDown, ControlError
from radix_ext.sglang.hints import ChainIntent
from radix_ext.sglang.report import report_of
from radix_ext.tree import Namespace, NodeInfo, ProbeResult
from session_runtime.accounting import StepAccounting, attention_work
from session_runtime.backends.base import Backend, Cancellation, ChainState, StepRequest, StepResult, StepTiming
from session_runtime.backends.sglang.after import OwnerQueue
from session_runtime.backends.sglang.control_client import RequestControl
from session_runtime.direct_http import DirectPool, TransportError
from session_runtime.turns import common_prefix
from session_runtime.constrained.grammar import whole_tag
from session_runtime.errors import BackendUnavailable, ContextTooLong, InvalidRequest, PoolExhausted
from session_runtime.metrics import Sample, gauge

logger = logging.getLogger(__name__)

USER_PRIORITY = 1  # with --enable-priority-scheduling a higher value runs first
BACKGROUND_PRIORITY = 0
# How long a turn's close (or a tool wait's start) may wait to ride the
# conversation's next request before it leaves in one batch with every other
# conversation's (after.py): an agent that steps again within it pays no round
# trip for it; the close is off the step's path either way.
RIDE_S = 0.5
_JSON = {"content-type": "application/json"}
_NON_STR_KEYS = orjson.OPT_NON_STR_KEYS  # keys written as json.dumps writes them


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
        self.server = server  # a LaunchedServer, or None for --sglang-url
        self.restarts = 0
        self._closing = False
        self._restart_lock = threading.Lock()
        self._restarting: Optional[threading.Thread] = None
        self.last_answer = time.monotonic()  # when the server last sent anything (a chunk, a command's answer)
        self._streams: dict[object, list] = {}  # open step streams -> [abandoned, its hang-up]
        self._streams_lock = threading.Lock()
        # Commands run on these threads; their callers wait for the answer or for
        # `abandon`, whichever comes first (a hung server's answer never comes).
        self._commands = ThreadPoolExecutor(max_workers=32, thread_name_prefix="sglang-command")
        self._gone: Future = Future()  # resolved by abandon(): the commands waiting then fail
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
        if server is not None:  # a launched server's death is seen within a second, step or no step
            threading.Thread(target=self._watch_server, name="sglang-watch", daemon=True).start()

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
        self._check_server()
        t0 = time.perf_counter()
        prompt = list(req.prompt)
        forced = None if req.forced is None else list(req.forced)
        self._validate(prompt, forced, req.sampling.max_tokens)
        n = len(prompt)
        # A tool wait or idle retirement may have demoted this chain, or another
        # conversation's whose host copy this prompt continues (shared).
        promote = bool(self._maybe_on_host)
        body = self._body(req, prompt, forced, promote, riding)
        chunks = self._stream(body, req.cancel)
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
            raise self._abort_error(reason.get("message") if reason else "the stream ended without a result")
        end_t = time.perf_counter()
        first_t = first_t or end_t
        stop_sequence = None
        if forced is not None:
            output, finish = forced, "forced"
            computed = prompt + forced
            for tok in forced if req.on_token else ():
                req.on_token(tok)
            logprobs = _forced_logprobs(meta, len(forced)) if req.sampling.logprobs else None
        else:
            finish = "stop" if reason.get("type") == "stop" else "length"
            matched = reason.get("matched")
            stop_sequence = matched if finish == "stop" and isinstance(matched, str) else None
            computed = prompt + output[:-1] if output else prompt
            logprobs = [e[0] for e in meta.get("output_token_logprobs") or []] if req.sampling.logprobs else None
        report = report_of(meta) or {}
        if report.get("error"):
            logger.error("the tree's pre-actions for a step of %s failed: %s", req.owner, report["error"])
        for (name, _), got in zip(riding, report.get("before") or ()):
            if not got.get("ok"):
                logger.warning("the %s that rode a step of %s failed: %s", name, req.owner, got.get("error"))
        if promote and not report.get("on_host", True):
            self._maybe_on_host.discard(req.owner)
        logical = int(report.get("logical_len", 0))
        cached = min(int(meta.get("cached_tokens") or 0), n)
        promoted = report.get("promoted") or {}
        anchor, count = int(promoted.get("anchor", 0)), int(promoted.get("tokens", 0))
        host_loaded = min(count, max(0, cached - anchor))  # promoted tokens this request reused
        cached -= host_loaded
        ps = self.page_size
        upto = len(computed) if req.cache_output else n
        # The chain keeps its partial last page privately; the tree alone, whole pages.
        inserted = upto if req.hold_chain else upto // ps * ps
        total_ms = (end_t - t0) * 1e3
        accounting = StepAccounting(
            prompt_tokens=n, cached_input_tokens=cached, host_loaded_tokens=host_loaded,
            uncached_prefill_tokens=n - cached - host_loaded,
            logical_reusable_tokens=max(logical, cached + host_loaded),
            alignment_loss_tokens=max(0, logical - cached - host_loaded),
            recomputed_history_tokens=max(0, min(req.history_len, n) - cached - host_loaded),
            active_context_length=len(computed), output_tokens=len(output),
            kv_device_bytes=inserted * self.bytes_per_token, kv_host_bytes=0,
            # SGLang does not report its prefill time per request: the first
            # token as this client sees it bounds it from above.
            prefill_ms=(first_t - t0) * 1e3, ttft_ms=(first_t - t0) * 1e3,
            tpot_ms=((last_t - first_t) / (len(output) - 1) * 1e3) if forced is None and len(output) > 1 and last_t else 0.0,
            attention_work=attention_work(n - cached - host_loaded, cached + host_loaded),
        )
        probes = [ProbeResult(logical_len=p[0], device_len=p[1]) for p in report.get("probes") or ()]
        # A streamed sampled step's report left with its first chunk: the chain then
        # holds the step's whole computed sequence (radix_ext/sglang/report.py).
        held = report.get("chain_tokens", len(computed) if req.hold_chain else None)
        chain = None if held is None or not report else ChainState(
            tokens=int(held), host_bytes=int(report.get("host_bytes", 0)),
            free_fraction=float(report.get("free_fraction", 1.0)))
        return StepResult(output=output, finish_reason=finish, stop_sequence=stop_sequence, sequence=computed,
                          logprobs=logprobs,
                          accounting=accounting, timing=StepTiming(total_ms, total_ms, 0.0),
                          probes=probes if len(probes) == len(req.probe_prompts) else None, chain=chain)

    def _validate(self, prompt: list[int], forced: Optional[list[int]], max_tokens: int) -> None:
        n = len(prompt)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        extra = len(forced or ())
        if n + extra >= self.max_context:
            raise ContextTooLong(f"prompt of {n} tokens (plus {extra} forced) does not fit the context "
                                 f"limit of {self.max_context}")
        ids = prompt + (forced or [])
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise InvalidRequest(f"token id out of the model's vocabulary (0..{self.vocab_size - 1})")
        # SGLang queues what does not fit yet; what can never fit is refused here.
        if n + extra > self.capacity:
            raise PoolExhausted(f"the step needs {n + extra} KV slots; the server's pool holds {self.capacity}")

    def _body(self, req: StepRequest, prompt: list[int], forced: Optional[list[int]], promote: bool,
              riding: Sequence = ()) -> dict:
        sp = req.sampling
        if forced is None and sp.constrained and not self.constrains:
            raise InvalidRequest(f"the SGLang server at {self.url} runs with --skip-tokenizer-init, so it cannot "
                                 "force a tool, follow a JSON schema or match stop sequences; start it with its "
                                 "tokenizer and --grammar-backend xgrammar")
        intent = ChainIntent(hold=req.hold_chain, cache_limit=None if req.cache_output else len(prompt),
                             promote=promote, share=promote, probes=tuple(_relative(p, prompt) for p in req.probe_prompts),
                             holder=self.holder if self.lease_s > 0 else None, lease_s=self.lease_s,
                             before=tuple(riding))
        params: dict = {"temperature": sp.temperature, "top_p": sp.top_p, "stop_token_ids": sorted(sp.stop_token_ids)}
        if sp.top_k:
            params["top_k"] = sp.top_k
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed % 2**31
        if sp.stop:  # matched by SGLang in the decoded output, as our engine matches them
            params["stop"] = list(sp.stop)
        tag = whole_tag(sp.grammar, sp.think_end, sp.think_budget, sorted(sp.stop_token_ids))
        if tag is not None:  # compiled by the server's grammar backend (xgrammar), reasoning block included
            params["structural_tag"] = tag
        body: dict = {
            "input_ids": prompt if forced is None else prompt + forced,
            "sampling_params": params, "stream": True, "session_id": req.owner,
            "kv_hints": intent.envelope(uuid.uuid4().hex),
            "priority": BACKGROUND_PRIORITY if req.background else USER_PRIORITY,
        }
        if req.namespace.extra_key is not None:
            body["extra_key"] = req.namespace.extra_key
        if req.namespace.cache_salt is not None:
            body["cache_salt"] = req.namespace.cache_salt
        if forced is None:
            params["max_new_tokens"] = min(sp.max_tokens, self.max_context - len(prompt))
            body["return_logprob"] = sp.logprobs
        else:
            params["max_new_tokens"] = 0
            if sp.logprobs and forced:
                # Logprobs of the forced tokens: SGLang gives input position i the
                # logprob of token i given 0..i-1, and none for the first position.
                body["return_logprob"] = True
                body["logprob_start_len"] = len(prompt) - 1
        return body

    def _stream(self, body: dict, cancel: Optional[Cancellation] = None):
        """Yield each streamed JSON chunk. Raises BackendUnavailable when the
        server cannot be reached or is abandoned as hung (`abandon`),
        InvalidRequest when it refuses the request. A step that is cancelled,
        or whose deadline passes, while no chunk comes (queued in the
        scheduler) closes the stream at once: SGLang aborts the request, and
        the step fails with the cancellation's error."""
        stop = None
        token = object()  # this stream, in _streams from before its request is sent: abandon() may hang it up

        def opened(hang_up: Callable[[], None]) -> None:
            with self._streams_lock:
                self._streams[token] = [False, hang_up]

        try:
            # orjson: the prompt's ids are most of the body, and a long context's are
            # ~10x faster to write than with json (10 ms at 100k tokens, measured here)
            with self.step_http.post("/generate", orjson.dumps(body, option=_NON_STR_KEYS), _JSON,
                                     opened=opened) as resp:
                stop = cancel.watch(resp.hang_up) if cancel is not None else None
                if resp.status >= 400:
                    raise self._http_error(resp.status, resp.read().decode(errors="replace"))
                for chunk in sse_chunks(resp.iter_lines()):
                    self.last_answer = time.monotonic()
                    if "error" in chunk:
                        raise self._abort_error(str(chunk["error"]))
                    yield chunk
            if self._abandoned(token):
                raise TransportError("its stream was closed: the server stopped answering")
        except Exception as exc:
            if cancel is not None and cancel.error is not None:  # we closed it
                raise cancel.error from None
            if isinstance(exc, TransportError) or self._abandoned(token):
                raise BackendUnavailable(self._down(str(exc))) from None
            raise
        finally:
            if stop is not None:
                stop()
            with self._streams_lock:
                self._streams.pop(token, None)

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
        self.last_answer = time.monotonic()
        return True

    def _abandoned(self, token) -> bool:
        with self._streams_lock:
            return token in self._streams and self._streams[token][0]

    def abandon(self) -> int:
        """The server stopped answering (hung, or its processes died): close
        every step stream open on it, and stop waiting for the commands sent
        to it, so those steps and commands fail at once with the retryable
        BackendUnavailable rather than wait for their read timeouts (a step so
        failed changes nothing). Returns how many steps were open."""
        with self._streams_lock:
            open_now = list(self._streams.values())
            for entry in open_now:
                entry[0] = True
            gone, self._gone = self._gone, Future()
        for _, hang_up in open_now:
            hang_up()
        gone.set_result(None)
        return len(open_now)

    # ----- a launched server that dies is started again ------------------------

    def available(self) -> bool:
        return self.server is None or (self.server.alive() and self._restarting is None)

    def _check_server(self) -> None:
        """Raise BackendUnavailable while a launched server is down, and start it
        again (once, in the background) when it or one of its processes has
        exited. Its tree starts empty: the conversations' next steps rebuild
        their KV by prefill."""
        if self.server is None or self.server.alive() and self._restarting is None:
            return
        if self.revive():
            raise BackendUnavailable(f"SGLang server at {self.url} is restarting after it exited; nothing "
                                     "changed, retry in a minute")

    def revive(self) -> bool:
        """Start a launched server again (in the background) when it, or one of
        its scheduler or detokenizer processes, has exited; what is left of it
        is stopped first. Returns whether it is restarting."""
        if self.server is None:
            return False
        with self._restart_lock:
            if self._restarting is None and not self.server.alive() and not self._closing:
                code, dead = self.server.process.poll(), self.server.dead_members()
                logger.error("SGLang's server at %s %s; starting it again", self.url,
                             f"exited with code {code}" if code is not None else
                             f"lost its process{'es' if len(dead) > 1 else ''} {dead}")
                self.abandon()
                self._restarting = threading.Thread(target=self._restart, name="sglang-restart", daemon=True)
                self._restarting.start()
            return self._restarting is not None

    def _watch_server(self) -> None:
        """Start a launched server again once it, or one of its processes, died
        after it had served (what it held is abandoned: a step in flight fails
        at once, retryably). One that failed to start again is left to the next
        step, as before, rather than started in a loop."""
        while not self._stop.wait(1.0):
            server = self.server
            if server.members and not server.alive():
                self.revive()

    def _restart(self) -> None:
        from session_runtime.backends.sglang.launcher import LaunchFailed, relaunch

        try:
            self.server.stop()  # what is left of its process group
            relaunch(self.server, on_spawn=self._adopt)
            self.restarts += 1
            logger.warning("SGLang's server is back at %s after %.0f s", self.url, self.server.started_s)
        except LaunchFailed as exc:
            logger.error("SGLang's server did not come back: %s", exc)
        finally:
            with self._restart_lock:
                self._restarting = None

    def _adopt(self, server) -> None:
        """The restarted server's process exists: from now on close() stops it."""
        with self._restart_lock:
            self.server = server
            if self._closing:  # the runtime stopped while this one started
                server.stop()

    def _down(self, why: str) -> str:
        state = ""
        if self.server is not None and not self.server.alive():
            code = self.server.process.poll()
            state = (f" (the SGLang process exited with code {code})" if code is not None
                     else f" (its processes {self.server.dead_members()} exited)")
        return f"SGLang server at {self.url} is unavailable{state}: {why}; nothing changed, retry once it is back"

    def _http_error(self, status: int, text: str):
        try:
            message = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        if status >= 500:
            return BackendUnavailable(self._down(f"HTTP {status}: {message}"))
        return InvalidRequest(f"SGLang refused the step: {message}")

    def _abort_error(self, message: Optional[str]):
        message = message or "aborted"
        if self.server is not None and not self.server.alive():
            return BackendUnavailable(self._down(message))
        lowered = message.lower()
        if "kv" in lowered and ("memory" in lowered or "pool" in lowered or "cache" in lowered):
            return PoolExhausted(f"SGLang aborted the step: {message}")
        return InvalidRequest(f"SGLang aborted the step: {message}")

    # ----- the tree, by command requests ---------------------------------------

    def _call(self, name: str, **args):
        """A command, after what is queued for after earlier steps (`after.py`);
        the caller waits for it (`waited_commands` counts them)."""
        self.after.settle()
        self.waited_commands += 1
        return self._send(name, **args)

    def _send(self, name: str, **args):
        self._check_server()
        with self._streams_lock:
            gone = self._gone
        try:
            command = self._commands.submit(self.control.call, name, **args)
        except RuntimeError:  # its threads are shut down
            raise BackendUnavailable(f"the runtime closed its connection to SGLang at {self.url}") from None
        wait((command, gone), return_when=FIRST_COMPLETED)
        if not command.done():
            raise BackendUnavailable(self._down(f"it stopped answering; the {name!r} command is not awaited"))
        try:
            answer = command.result()
        except ChannelDown as exc:
            raise BackendUnavailable(self._down(exc.message)) from None
        self.last_answer = time.monotonic()
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
        if self.server is not None:
            with self._restart_lock:
                self._closing = True
                server, restarting = self.server, self._restarting
            server.stop()  # a restart under way stops at once: its wait sees it
            if restarting is not None:
                restarting.join(timeout=10)
            self.server.stop()


def sse_chunks(lines):
    """The JSON objects of SGLang's `/generate` stream (`data: {...}` lines, as
    bytes, up to `data: [DONE]`)."""
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            for _ in lines:  # read to the stream's end: a response closed unread closes its
                pass  # connection, and the next request would open one (connect, and the server's accept)
            return
        yield orjson.loads(data)


def _relative(probe: Sequence[int], prompt: list[int]) -> tuple[int, list[int]]:
    """A probe prompt as (tokens it shares with the step's prompt, the rest)."""
    shared = common_prefix(probe, prompt)
    return shared, list(probe[shared:])


def _ns(namespace: Namespace) -> dict:
    return {"extra_key": namespace.extra_key, "cache_salt": namespace.cache_salt}


def _forced_logprobs(meta: dict, count: int) -> list[float]:
    entries = meta.get("input_token_logprobs") or []
    values = [e[0] for e in entries[1:]]
    assert len(values) == count, f"SGLang returned {len(values)} input logprobs for {count} forced tokens"
    return values
