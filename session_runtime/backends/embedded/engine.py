"""The embedded engine: one decoder over SGLang's pools and our SessionRadixCache.

A step matches its prompt in the tree, prefills only the uncached suffix,
decodes (or appends forced output), inserts the computed sequence and moves
the owner's chain lock to the new tail. Steps are serialized by one lock; a
step that fails frees what it took and leaves the tree's contents and every
chain as they were.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

import torch

from radix_ext.host_tier import HostTier
from radix_ext.kv_copy import KVMover
from radix_ext.pools import KVPools, PoolSpec, build_pools
from radix_ext.tree import Namespace, NodeInfo, ProbeResult, SessionRadixCache
from session_runtime.accounting import StepAccounting, attention_work
from session_runtime.backends.base import Backend, Cancellation, StepRequest, StepResult, StepTiming
from session_runtime.config import RuntimeConfig
from session_runtime.constrained.matcher import Guard, Guards
from session_runtime.backends.embedded.fairlock import FairRLock
from session_runtime.backends.embedded.decode import decode
from session_runtime.backends.embedded.engine_host import HostTierOps
from session_runtime.backends.embedded.offload import OffloadManager
from session_runtime.backends.embedded.reads import LastReads, samples
from session_runtime.backends.embedded.slots import SlotBuffer
from session_runtime.errors import ContextTooLong, InvalidRequest, PoolExhausted
from session_runtime.metrics import Sample
from session_runtime.model.decoder import Decoder

class Engine(HostTierOps, Backend):
    """Owns the decoder, the pools and the tree. Thread-safe: everything holds
    `lock`, which concurrent steps hand over token by token (`FairRLock`)."""

    name = "embedded"
    supports_offload = True
    supports_top_logprobs = True
    is_embedded_engine = True  # Runtime.engine: the engine's internals, for its own tests and benchmarks

    def make_offload(self, background: bool = True, idle_ttl_s: float = 0.0):
        return OffloadManager(self, background=background, idle_ttl_s=idle_ttl_s)

    def __init__(self, config: RuntimeConfig, decoder: Decoder, guards: Optional[Guards] = None):
        self.config = config
        self.decoder = decoder
        self.guards = guards  # constrained output (grammars, stop sequences); None: the engine refuses them
        cfg = decoder.cfg
        self.pools: KVPools = build_pools(
            PoolSpec(
                pool_tokens=config.pool_tokens, page_size=config.page_size,
                max_running=config.max_running, max_context=config.max_context,
                num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, dtype=config.torch_dtype, device=config.device,
            )
        )
        self.tree = SessionRadixCache.over_pools(self.pools)
        self.bytes_per_token = self.pools.spec.bytes_per_token
        self.page_size = config.page_size
        self.capacity = self.pools.capacity
        self.mover = KVMover(self.pools.kv)
        self.host = HostTier(self._host_arena(config.host_tokens(self.bytes_per_token)))
        self.lock = FairRLock()  # handed over in arrival order: steps interleave token by token
        # Called with the missing token count when even eviction cannot make
        # room: the offload manager demotes waiting conversations there.
        self.on_pressure: Optional[Callable[[int], None]] = None
        self.stepping: set[str] = set()  # owners of the steps in flight: pressure must not move their chains
        self.rows = threading.BoundedSemaphore(config.max_running)  # steps in flight: one request row each
        self.reads = LastReads(self.lock)  # operator reads that never wait on a step for long
        self._reloaded: dict[str, tuple[int, int]] = {}  # owner -> (anchor, tokens) reloaded for its next step
        self.device = torch.device(config.device)

    def _host_arena(self, tokens: int):
        """The host tier's arena, allocated once. Raises InvalidRequest when the
        machine cannot provide it."""
        try:
            return self.mover.empty(tokens)
        except (RuntimeError, MemoryError) as exc:
            gib = tokens * self.bytes_per_token / 2**30
            raise InvalidRequest(
                f"cannot allocate the host tier: {tokens} tokens x {self.bytes_per_token} bytes "
                f"= {gib:.1f} GiB{' pinned' if self.mover.pinned else ''} ({exc}); lower --host-pool-tokens"
            ) from exc

    def warmup(self) -> None:
        """One throw-away forward so the first request does not pay for kernel
        initialisation (about 1.7 s on CPU). Leaves the pool as it found it."""
        with self.lock:
            ps = self.config.page_size
            slots = self.alloc(ps)
            try:
                n = min(ps, 8)
                ids = torch.zeros(n, dtype=torch.int64, device=self.device)
                pos = torch.arange(n, device=self.device)
                self.decoder(ids, pos, slots[:n], slots[:n], self.pools.kv)
                self.decoder(ids[:1], pos[n - 1 :], slots[n - 1 : n], slots[:n], self.pools.kv)
                self._sync()
            finally:
                self.pools.allocator.free(slots)

    # ----- pool ---------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Page-aligned slots for `num_tokens`, evicting LRU leaves if short.
        Raises PoolExhausted; allocates nothing in that case."""
        ps = self.config.page_size
        need = -(-num_tokens // ps) * ps
        allocator = self.pools.allocator
        # Evict only when that is enough: a request that cannot fit anyway must
        # not throw away other conversations' cached branches (or move idle and
        # waiting chains off the device) on its way out.
        if allocator.available_size() + self.tree.evictable_size() < need <= self.capacity and self.on_pressure is not None:
            self.on_pressure(need - allocator.available_size() - self.tree.evictable_size())
        if allocator.available_size() < need <= allocator.available_size() + self.tree.evictable_size():
            self.tree.evict_tokens(need - allocator.available_size())
        slots = allocator.alloc(need)
        if slots is None:
            raise PoolExhausted(
                f"need {need} KV slots, {allocator.available_size()} free after evicting every "
                f"unlocked leaf ({self.tree.protected_size()} tokens are locked by conversations)"
            )
        return slots

    # ----- steps --------------------------------------------------------------

    def step(self, req: StepRequest) -> StepResult:
        """Run one step for `req.owner`. On success the owner's chain is the new
        sequence; on any error the chain and the pool are as before. Raises
        InvalidRequest, ContextTooLong or PoolExhausted."""
        # What `reload` brought back for this step; a step that fails below
        # still consumes it (the reloaded pages simply stay cached).
        reloaded = self._reloaded.pop(req.owner, None)
        n = len(req.prompt)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        if n + len(req.forced or ()) >= self.config.max_context:
            raise ContextTooLong(
                f"prompt of {n} tokens (plus {len(req.forced or ())} forced) does not fit the context "
                f"limit of {self.config.max_context}"
            )
        if req.forced is None and not getattr(self.decoder, "samples", True):
            raise InvalidRequest("this engine runs no model (replay --no-model): it replays forced output only, "
                                 "and this step would sample")
        vocab = self.decoder.cfg.vocab_size
        if max(req.prompt) >= vocab or min(req.prompt) < 0 or (
            req.forced and (max(req.forced) >= vocab or min(req.forced) < 0)
        ):
            raise InvalidRequest(f"token id out of the model's vocabulary (0..{vocab - 1})")
        guard = None  # the step's grammar and stop sequences, compiled before it waits for the engine
        if req.forced is None and req.sampling.constrained:
            if self.guards is None:
                raise InvalidRequest("this engine was built without constrained output (grammars, stop sequences)")
            guard = self.guards.for_step(req.sampling, vocab)
        with self.rows, self.lock:
            self.stepping.add(req.owner)
            try:
                return self._step_locked(req, reloaded, guard)
            finally:
                self.stepping.discard(req.owner)

    def _step_locked(self, req: StepRequest, reloaded: Optional[tuple[int, int]] = None,
                     guard: Optional[Guard] = None) -> StepResult:
        t0 = time.perf_counter()
        prompt = list(req.prompt)
        n = len(prompt)
        key = req.namespace.key(prompt)
        reloaded = reloaded or self._promote(req.owner, req.namespace, prompt)
        if not reloaded[1]:  # another conversation's offloaded prefix, shared instead of prefilled again
            reloaded = self._share(req.owner, req.namespace, prompt)
        probe = self.tree.probe(key[: n - 1])
        # The last prompt token is always computed: its logits start the output.
        node, prefix_slots = self.tree.match_and_lock(key[: n - 1])
        # The conversation's own partial last page continues the match exactly.
        tail = self.tree.take_tail(req.owner, node, key, n - 1)
        buf = SlotBuffer(self, node, prefix_slots, tail)
        m = buf.prefix_len
        row = None
        try:
            row = self._alloc_row()
            result = self._run(req, prompt, m, buf, row, max(probe.logical_len, m), t0, reloaded, guard)
        except BaseException:
            if not buf.committed:
                buf.release(req.owner)
                self.tree.dec_lock_ref(node)
            raise
        finally:
            if row is not None:
                self.pools.req_to_token.free_rows([row])
        return result

    def _alloc_row(self) -> int:
        rows = self.pools.req_to_token.alloc_rows(1)
        if rows is None:
            raise PoolExhausted("no free request row: too many steps in flight")
        return rows[0]

    def _forward(self, ids: list[int], start: int, buf: SlotBuffer, row: int, all_logits: bool,
                 cancel: Optional[Cancellation] = None) -> torch.Tensor:
        """Run `ids` at positions start.. in chunks of `prefill_chunk` tokens, so
        attention over a long prompt never materialises a full q x n score matrix;
        the turn passes between chunks."""
        chunk = self.config.prefill_chunk
        outs = []
        for i in range(0, len(ids), chunk):
            last = i + chunk >= len(ids)
            part = self._forward_chunk(ids[i : i + chunk], start + i, buf, row, all_logits)
            if all_logits or last:
                outs.append(part)
            if not last:
                self._pass_turn(cancel)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _pass_turn(self, cancel: Optional[Cancellation] = None) -> None:
        """Between two forwards: stop if the step was cancelled (it fails and
        changes nothing), and let whoever waits for the engine go first (another
        step's forward, a reload, a snapshot). This step's request row, KV buffer
        and locked prefix are its own meanwhile: other steps and pressure
        (`stepping`) leave them alone."""
        if cancel is not None:
            cancel.check()
        if self.lock.waiting():
            self._sync()
            self.lock.yield_to_waiters()

    def _forward_chunk(self, ids: list[int], start: int, buf: SlotBuffer, row: int, all_logits: bool) -> torch.Tensor:
        end = start + len(ids)
        buf.ensure(end)
        r2t = self.pools.req_to_token
        r2t.write((row, slice(start, end)), buf.slots[start:end].to(torch.int32))
        return self.decoder(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.arange(start, end, device=self.device),
            buf.slots[start:end],
            r2t.req_to_token[row, :end].to(torch.int64),
            self.pools.kv,
            all_logits=all_logits,
        )

    def _run(self, req, prompt, m, buf, row, logical, t0, reloaded: tuple[int, int],
             guard: Optional[Guard] = None) -> StepResult:
        n = len(prompt)
        sp = req.sampling
        r2t = self.pools.req_to_token
        r2t.write((row, slice(0, m)), buf.slots[:m].to(torch.int32))
        model_s = 0.0
        kept_logits: list[torch.Tensor] = []

        t = time.perf_counter()
        if req.cancel is not None:
            req.cancel.check()
        logits = self._forward(prompt[m:], m, buf, row, all_logits=req.return_logits, cancel=req.cancel)
        self._sync()
        prefill_s = time.perf_counter() - t
        model_s += prefill_s
        if req.on_prefill is not None:
            req.on_prefill(n, m)  # m: matched on the device, host pages reloaded before the step included
        if req.return_logits:
            kept_logits.append(logits)

        out = decode(req, prompt, logits, lambda ids, at, every, cancel=None: self._forward(ids, at, buf, row, every, cancel),
                     self._pass_turn, self._sync, min(sp.max_tokens, self.config.max_context - n), guard)
        model_s += out.model_s
        if req.return_logits:
            kept_logits += out.logits
        output, computed, first_token_t, decode_end_t = out.output, out.computed, out.first_token_t, out.decode_end_t

        chain_len = buf.commit(req, computed)
        anchor, count = reloaded
        host_loaded = min(count, max(0, m - anchor))  # reloaded tokens this prefill reused
        ps = self.config.page_size
        accounting = StepAccounting(
            prompt_tokens=n,
            cached_input_tokens=m - host_loaded,
            host_loaded_tokens=host_loaded,
            uncached_prefill_tokens=n - m,
            logical_reusable_tokens=logical,
            alignment_loss_tokens=logical - m,
            recomputed_history_tokens=max(0, min(req.history_len, n) - m),
            active_context_length=len(computed),
            output_tokens=len(output),
            kv_device_bytes=chain_len * self.bytes_per_token,
            kv_host_bytes=self.host.bytes_of(req.owner),
            prefill_ms=prefill_s * 1e3,
            ttft_ms=(first_token_t - t0) * 1e3,
            tpot_ms=((decode_end_t - first_token_t) / (len(output) - 1) * 1e3) if len(output) > 1 else 0.0,
            attention_work=attention_work(n - m, m),
        )
        cached_upto = len(computed) if req.cache_output else n
        assert chain_len == (cached_upto if req.hold_chain else cached_upto // ps * ps), (
            "the chain must hold the sequence")
        total_s = time.perf_counter() - t0
        return StepResult(
            output=output,
            finish_reason=out.finish,
            stop_sequence=out.stop_sequence,
            sequence=computed,
            logprobs=out.logprobs if sp.logprobs else None,
            accounting=accounting,
            timing=StepTiming(total_s * 1e3, model_s * 1e3, (total_s - model_s) * 1e3),
            logits=torch.cat(kept_logits) if kept_logits else None,
            top_logprobs=out.tops if sp.top_logprobs else None,
        )

    def lock_prefix(self, owner: str, namespace: Namespace, tokens: Sequence[int], free_branch: bool = False) -> int:
        """Move `owner`'s chain to `tokens` (the fork point after a turn drops its
        reasoning): the cached pages, plus the fork's partial page copied.
        Whatever the old chain held beyond becomes evictable, or with
        `free_branch` is freed at once where nothing else holds it. Returns the
        chain's length."""
        with self.lock:
            return self.tree.hold_prefix(owner, namespace.key(list(tokens)), free_branch)

    def probe(self, namespace: Namespace, tokens: Sequence[int]) -> ProbeResult:
        """What a step with this prompt would reuse, without changing the tree.
        The last token is excluded: it is always computed for its logits."""
        with self.lock:
            return self.tree.probe(namespace.key(list(tokens))[: max(len(tokens) - 1, 0)])

    def _sync(self) -> None:
        """Wait for the compute stream, not for the host tier's copies on theirs."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ----- chains and inspection ---------------------------------------------

    def release(self, owner: str) -> None:
        """Forget the owner: unlock its chain, drop its host copy and any lost-tail record."""
        with self.lock:
            self.tree.release_chain(owner)
            self.host.take(owner)
            self.host.forget_evicted(owner)

    def chain_tokens(self, owner: str) -> int:
        with self.lock:
            return self.tree.chain_tokens(owner)

    def chain_lengths(self) -> dict[str, int]:
        with self.lock:
            return {owner: self.tree.chain_tokens(owner) for owner in list(self.tree.chains)}

    def peek_chain_tokens(self, owner: str) -> Optional[int]:
        return self.reads.get(("chain", owner), lambda: self.tree.chain_tokens(owner))

    def peek_chain_lengths(self) -> dict[str, int]:
        return self.reads.get(("chains",), lambda: {o: self.tree.chain_tokens(o) for o in list(self.tree.chains)}, {})

    def host_bytes(self, owner: str) -> int:
        return self.host.bytes_of(owner)

    def snapshot(self, preview, owner: Optional[str] = None) -> list[NodeInfo]:
        return self.reads.get(("snapshot", owner), lambda: self.tree.snapshot(
            preview=preview, owner=owner, both=self.both_nodes()) + self.host_nodes(preview, owner=owner), [])

    def free_fraction(self) -> float:
        with self.lock:
            return (self.pools.allocator.available_size() + self.tree.evictable_size()) / self.pools.capacity

    def metric_samples(self) -> list[Sample]:
        return self.reads.get(("metric_samples",), lambda: samples(self.pools, self.tree, self.host), [])

    def describe(self) -> str:
        return (f"embedded engine (page size {self.page_size}, pool {self.capacity} tokens, host tier "
                f"{self.host.capacity_tokens} tokens, attention {self.decoder.attention.name})")

    def check_integrity(self) -> None:
        with self.lock:
            self.tree.check_integrity()
            self.host.check()
            for owner, entry in list(self.host.entries.items()):
                assert entry.on_device or self.tree.chain_tokens(owner) == entry.anchor_tokens, (
                    f"host entry of {owner} does not hang from its chain"
                )
            r2t = self.pools.req_to_token
            assert r2t.available_size() == r2t.size, "a request row leaked"
