"""The one interface the runtime talks to, and the step types it exchanges.

Three implementations, each in its own folder: `embedded` (our decoder over
SGLang's pools, one step at a time, in this process), `sglang` (SGLang's
own server, batched, with `radix_ext` as its radix-cache backend) and
`upstream` (a provider's API answers each step; no KV here). Nothing
outside a backend's folder imports its internals; `create_backend`
(backends/__init__.py) picks one by name and imports it lazily, and this
module imports none of them.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from radix_ext.tree import Namespace, NodeInfo, ProbeResult
from session_runtime.accounting import StepAccounting
from session_runtime.errors import DeadlineExceeded, RuntimeErrorBase
from session_runtime.metrics import Sample
from session_runtime.offload import NoOffload
from session_runtime.sampling import SamplingParams
from session_runtime.templates.base import Message


DEADLINE_PASSED = "the step ran past the request deadline (--request-deadline-s)"


class _Deadlines:
    """One thread for every watched deadline (a thread per step would be made
    and torn down on every SGLang step): it cancels each Cancellation whose
    deadline passes while it is watched."""

    def __init__(self) -> None:
        self._due: dict = {}  # Cancellation -> deadline
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._wakes = float("inf")  # when the thread wakes next, unless notified

    def add(self, cancel: "Cancellation") -> None:
        with self._cond:
            self._due[cancel] = cancel.deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="step-deadlines", daemon=True)
                self._thread.start()
            if cancel.deadline < self._wakes:  # most deadlines come after those already watched:
                self._cond.notify()  # waking the thread for each would cost every step a GIL hand-off

    def discard(self, cancel: "Cancellation") -> None:
        with self._cond:
            self._due.pop(cancel, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                passed = [c for c, t in self._due.items() if t <= now]
                for c in passed:
                    del self._due[c]
                if not passed:
                    self._wakes = min(self._due.values(), default=now + 60) + 0.01
                    self._cond.wait(self._wakes - now)
                    self._wakes = float("-inf")  # awake: it reads every deadline before it waits again
            for c in passed:  # outside the lock: a watcher closes a stream
                c.cancel(DeadlineExceeded(DEADLINE_PASSED))


class Cancellation:
    """Stops a step between two tokens: set from any thread (the client went away,
    shutdown), or by a deadline. The step checks it and fails, changing nothing."""

    def __init__(self, deadline_s: Optional[float] = None):
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.error: Optional[RuntimeErrorBase] = None
        self._watchers: list = []
        self._lock = threading.Lock()

    def cancel(self, error: RuntimeErrorBase) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            watchers, self._watchers = self._watchers, []
        for fn in watchers:
            fn()

    def watch(self, fn) -> "Callable[[], None]":
        """Call `fn` (once, from another thread) when the step is cancelled or its
        deadline passes, for a wait that no token ends (a request queued in a
        server): `fn` unblocks it, and the step then fails at `check`. Returns
        the function that stops watching."""
        with self._lock:
            fired = self.error is not None
            if not fired:
                self._watchers.append(fn)
        if fired:
            fn()
        elif self.deadline is not None:
            _DEADLINES.add(self)

        def stop() -> None:
            _DEADLINES.discard(self)
            with self._lock:
                if fn in self._watchers:
                    self._watchers.remove(fn)
        return stop

    def check(self) -> None:
        """Raises the reason when the step must stop."""
        if self.error is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.error = DeadlineExceeded(DEADLINE_PASSED)
        if self.error is not None:
            raise self.error


_DEADLINES = _Deadlines()


@dataclass(frozen=True)
class Transcript:
    """The conversation as its trace holds it, reasoning and the provider's
    continuation state included, for a backend that answers from messages
    (upstream proxy mode) rather than from token ids."""

    system: Optional[str]
    tools: Sequence[dict]
    messages: Sequence[Message]
    template: object  # the conversation's Template: the answer is recorded as its ids
    prefix: Optional[object] = None  # the conversation's last request (proxy/prefix.py OutboundPrefix)


@dataclass(frozen=True)
class WireReply:
    """What an upstream answered, as the trace records it: its reasoning,
    content and tool calls (the provider's call ids), the message to send back
    verbatim, and the step's upstream accounting."""

    reasoning: str
    content: str
    calls: tuple
    wire: str
    upstream: dict


@dataclass(frozen=True)
class StepRequest:
    owner: str  # the chain (conversation) that will hold the result
    prompt: Sequence[int]
    namespace: Namespace
    sampling: SamplingParams = field(default_factory=SamplingParams)
    forced: Optional[Sequence[int]] = None  # output to append instead of sampling
    history_len: int = 0  # prompt tokens that precede this step's new message
    return_logits: bool = False  # keep logits of every computed position (tests; embedded only)
    cache_output: bool = True  # False: cache only the prompt (SGLang --strip-thinking-cache)
    hold_chain: bool = True  # False: lock nothing after the step (SGLang: no sessions)
    on_token: Optional[Callable[[int], None]] = None  # called with each output token (streaming)
    # Called once the prompt is matched and prefilled, before the first output token:
    # (prompt tokens, those reused from the cache, device or host). Streams report usage early by it.
    on_prefill: Optional[Callable[[int, int], None]] = None
    background: bool = False  # idle-time work (a canonical branch): ranks below user steps
    cancel: Optional[Cancellation] = None  # checked between tokens
    transcript: Optional[Transcript] = None  # backends that answer from messages (wants_transcript)
    probe_prompts: Sequence[Sequence[int]] = ()  # probed on the tree before the step (probes_in_step backends)


@dataclass(frozen=True)
class StepTiming:
    total_ms: float
    model_ms: float  # decoder forwards and sampling
    session_ms: float  # tree match, probe, insert, lock moves, bookkeeping


@dataclass(frozen=True)
class ChainState:
    """The owner's chain and the pool, as a step or a turn's close left them."""

    tokens: int
    host_bytes: int
    free_fraction: float


@dataclass(frozen=True)
class StepResult:
    output: list[int]
    finish_reason: str  # "stop", "length" or "forced"
    sequence: list[int]  # tokens whose KV is computed: prompt + output (minus an unfed last token)
    logprobs: Optional[list[float]]
    accounting: StepAccounting
    timing: StepTiming
    logits: Optional[object] = None  # [computed positions, vocab] when return_logits (embedded)
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per output token: (id, logprob), best first
    wire: Optional[WireReply] = None  # upstream proxy mode
    probes: Optional[list[ProbeResult]] = None  # of StepRequest.probe_prompts, before the step (probes_in_step)
    chain: Optional[ChainState] = None  # the owner's chain after the step, when the backend reports it
    stop_sequence: Optional[str] = None  # the stop sequence the output ended on (finish_reason "stop")


class Backend(ABC):
    """What the runtime needs from whatever computes KV and holds the chains.

    Every method is thread-safe. `step` leaves the owner's chain at the new
    sequence on success and as it was on error; it raises InvalidRequest,
    ContextTooLong, PoolExhausted or BackendUnavailable."""

    name: str
    page_size: int
    bytes_per_token: int
    capacity: int  # device KV slots
    supports_offload: bool = False  # tool-wait offload to a host tier
    probes_in_step: bool = False  # `step` probes StepRequest.probe_prompts itself, before the step
    supports_top_logprobs: bool = False  # StepResult.top_logprobs
    holds_kv: bool = True  # False: a provider answers (no tree, no canonical branch)
    wants_transcript: bool = False  # steps carry the conversation's messages (upstream proxy mode)

    @abstractmethod
    def step(self, req: StepRequest) -> StepResult: ...

    def place(self, owner: str, worker: Optional[str] = None, stateless: bool = False) -> Optional[str]:
        """Many workers: the worker the conversation lives on (`worker`, a restored
        placement, when it is still usable); a `stateless` one (a throw-away
        conversation) may have none, its steps routed by sglang-router. One
        backend: None."""
        return None

    def worker_of(self, owner: str) -> Optional[str]:
        return None

    def route(self, owner: str) -> "Backend":
        """The backend that holds the owner's chain (many workers: its worker)."""
        return self

    @abstractmethod
    def probe(self, namespace: Namespace, tokens: Sequence[int]) -> ProbeResult:
        """What a step with this prompt would reuse, without changing the tree.
        The last token is excluded: it is always computed for its logits."""

    def probe_many(self, namespace: Namespace, prompts: Sequence[Sequence[int]]) -> list[ProbeResult]:
        """`probe` of each prompt, as one read of the tree."""
        return [self.probe(namespace, p) for p in prompts]

    @abstractmethod
    def lock_prefix(self, owner: str, namespace: Namespace, tokens: Sequence[int], free_branch: bool = False) -> int:
        """Move `owner`'s chain to `tokens` (a turn's fork point): the cached
        pages, plus the fork's partial page copied where the backend can. The
        branch past it is no longer held; with `free_branch` it is freed at once
        where no other chain or request holds it. Returns the chain's new length."""

    def close_turn(self, owner: str, namespace: Namespace, fork: Optional[Sequence[int]], free_branch: bool,
                   idle_ttl_s: Optional[float]) -> Optional[ChainState]:
        """A turn closed: hold the chain at `fork` (None: leave it), mark it idle
        (None: do not), and say what the chain and the pool hold now. A backend
        behind a network sends it after the step has answered, in order with the
        conversation's next call, and returns None: the step's own report
        (StepResult.chain) then stands for it."""
        if fork is not None:
            self.lock_prefix(owner, namespace, fork, free_branch=free_branch)
        if idle_ttl_s is not None:
            self.mark_idle(owner, idle_ttl_s)
        return ChainState(self.chain_tokens(owner), self.host_bytes(owner), self.free_fraction())

    def mark_idle(self, owner: str, ttl_s: float) -> None:
        """The owner's turn closed: its chain may leave the device after `ttl_s`
        idle seconds (0: only under pressure). A backend whose runtime-side
        offload manager tracks idle chains (the embedded engine) ignores it."""

    @abstractmethod
    def release(self, owner: str) -> None:
        """Forget the owner's chain (and any host copy of it)."""

    @abstractmethod
    def chain_tokens(self, owner: str) -> int: ...

    @abstractmethod
    def chain_lengths(self) -> dict[str, int]:
        """Tokens each owner's chain holds."""

    def peek_chain_tokens(self, owner: str) -> Optional[int]:
        """For operator views: `chain_tokens`, or a recent value (None: not known
        yet) rather than waiting on a busy backend."""
        return self.chain_tokens(owner)

    def peek_chain_lengths(self) -> dict[str, int]:
        """For operator views: `chain_lengths`, or a recent value."""
        return self.chain_lengths()

    @abstractmethod
    def snapshot(self, preview: Callable[[Sequence[int]], str], owner: Optional[str] = None) -> list[NodeInfo]:
        """The tree's nodes (or one owner's chain), parents first."""

    @abstractmethod
    def metric_samples(self) -> list[Sample]:
        """Pool and transfer figures for /metrics, in base units: none, or
        BackendUnavailable, when the backend cannot say now."""

    @abstractmethod
    def free_fraction(self) -> float:
        """Device slots free or reclaimable (unlocked cache) over the pool."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert pools, locks and chains add up (AssertionError otherwise)."""

    def adopt(self, owners: Sequence[str], release_others: bool = True) -> None:
        """The runtime knows these conversations (at start): a backend that may
        hold chains from before (a server given by URL) keeps theirs for this
        runtime and releases every other one (`release_others` False: leaves the
        others alone, as a fleet member must: store/fleet.py)."""

    def integrity(self) -> dict:
        """check_integrity, and what it found, for operators (ranks compared, ...)."""
        self.check_integrity()
        return {"ranks": 1}

    def available(self) -> bool:
        """Can it take a step now, as far as this process knows without asking
        (O(1): /health calls it)."""
        return True

    def make_offload(self, background: bool = True, idle_ttl_s: float = 0.0):
        """The tool-wait offload manager that fits this backend (NoOffload when it has no host tier)."""
        return NoOffload()

    def reload(self, owner: str, namespace: Namespace, prompt: list[int]) -> None:
        """Bring an offloaded tail back before the owner's next step (host tier)."""

    def drop_host_copy(self, owner: str) -> None:
        """The owner's host copy will not be reloaded: free it."""

    def host_bytes(self, owner: str) -> int:
        return 0

    def describe(self) -> str:
        """One line for the server's ready message."""
        return f"{self.name} backend"

    def close(self) -> None:
        """Stop what the backend started."""




class HoldsNoChain:
    """For a backend that holds no chain of its own (an upstream provider,
    sglang-router's routed steps): nothing to probe, hold, release or count.
    Put it first among the bases so these answers win."""

    def probe(self, namespace: Namespace, tokens: Sequence[int]) -> ProbeResult:
        return ProbeResult(logical_len=0, device_len=0)

    def probe_many(self, namespace: Namespace, prompts: Sequence[Sequence[int]]) -> list[ProbeResult]:
        return [ProbeResult(logical_len=0, device_len=0) for _ in prompts]

    def lock_prefix(self, owner: str, namespace: Namespace, tokens: Sequence[int], free_branch: bool = False) -> int:
        return 0

    def close_turn(self, owner: str, namespace: Namespace, fork: Optional[Sequence[int]], free_branch: bool,
                   idle_ttl_s: Optional[float]) -> Optional[ChainState]:
        return ChainState(tokens=0, host_bytes=0, free_fraction=1.0)

    def mark_idle(self, owner: str, ttl_s: float) -> None:
        pass

    def release(self, owner: str) -> None:
        pass

    def chain_tokens(self, owner: str) -> int:
        return 0

    def chain_lengths(self) -> dict[str, int]:
        return {}
