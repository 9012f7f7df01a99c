"""The engine's host-tier operations: demote a waiting conversation's exclusive
chain tail to host memory, reload it before the next prefill, or discard it.

A mixin of Engine: it uses the engine's lock, tree, pools, host tier and
allocator, and keeps the engine module to the step itself.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from radix_ext.host_tier import HostEntry, timed_ms
from radix_ext.tree import Namespace, NodeInfo
from session_runtime.errors import PoolExhausted


class HostTierOps:
    def reload(self, owner: str, namespace: Namespace, prompt: list[int]) -> None:
        """Bring the owner's offloaded tail back before its next step. The copy
        runs outside the engine lock, overlapping other conversations' steps;
        the step that follows counts the tokens as host_loaded. An entry the
        prompt does not continue is dropped (recomputed). Raises PoolExhausted,
        keeping the entry."""
        with self.lock:
            entry = self._take_entry(owner, prompt)
            if entry is None:
                return
            try:
                slots = self.alloc(len(entry.tokens))
            except PoolExhausted:
                self.host.entries[owner] = entry  # a failed request changes nothing
                raise
        t = time.perf_counter()
        self.pools.allocator.load_cpu_copy(entry.kv, slots)
        self._sync()
        with self.lock:
            self._reloaded[owner] = self._restore(owner, namespace, prompt, entry, slots, t)

    def _promote(self, owner: str, namespace: Namespace, prompt: list[int]) -> tuple[int, int]:
        """Inside a step (engine lock held): reload now. Returns (anchor depth,
        reloaded tokens)."""
        entry = self._take_entry(owner, prompt)
        if entry is None:
            return 0, 0
        try:
            slots = self.alloc(len(entry.tokens))
        except PoolExhausted:
            self.host.entries[owner] = entry
            raise
        t = time.perf_counter()
        self.pools.allocator.load_cpu_copy(entry.kv, slots)
        self._sync()
        return self._restore(owner, namespace, prompt, entry, slots, t)

    def _take_entry(self, owner: str, prompt: list[int]) -> Optional[HostEntry]:
        entry = self.host.take(owner)
        if entry is None:
            return None
        start, end = entry.anchor_tokens, entry.anchor_tokens + len(entry.tokens)
        if self.tree.chain_tokens(owner) != start or prompt[start:end] != list(entry.tokens):
            self.host.stats.lost_tokens += len(entry.tokens)
            return None
        return entry

    def _restore(self, owner, namespace: Namespace, prompt: list[int], entry: HostEntry, slots,
                 t: float) -> tuple[int, int]:
        start, end = entry.anchor_tokens, entry.anchor_tokens + len(entry.tokens)
        if self.tree.chain_tokens(owner) != start:  # the chain moved meanwhile: the copy is stale
            self.pools.allocator.free(slots)
            self.host.stats.lost_tokens += len(entry.tokens)
            return 0, 0
        prefix_len = self.tree.restore_tail(owner, namespace.key(prompt[:end]), slots)
        if prefix_len > start:  # someone cached the same tokens meanwhile
            self.pools.allocator.free(slots[: prefix_len - start])
        self.host.record_promote(entry, timed_ms(t))
        return start, len(entry.tokens)

    def demote(self, owner: str) -> int:
        """Copy the owner's exclusive chain tail to the host and free its device
        pages. The copy runs outside the engine lock (the chain's lock keeps the
        pages alive and cached KV is never rewritten); a step of the same owner
        in between makes it a no-op. Returns the tokens demoted."""
        with self.lock:
            plan = self.tree.plan_demote(owner)
            if plan is None or not self.host.fits(len(plan.tokens)):
                return 0
        t = time.perf_counter()
        kv = self.pools.allocator.get_cpu_copy(plan.slots)
        with self.lock:
            return self._finish_demote(plan, kv, t)

    def discard(self, owner: str) -> int:
        """Free the owner's exclusive chain tail without a host copy: the next step
        recomputes it (InferCept's "discard", a baseline). Returns tokens freed."""
        with self.lock:
            plan = self.tree.plan_demote(owner)
            if plan is None:
                return 0
            self.tree.drop_tail(plan)
            self.host.stats.lost_tokens += len(plan.tokens)
            return len(plan.tokens)

    def demote_locked(self, owner: str) -> int:
        """`demote` with the copy under the lock (called from inside a step)."""
        with self.lock:
            plan = self.tree.plan_demote(owner)
            if plan is None or not self.host.fits(len(plan.tokens)):
                return 0
            t = time.perf_counter()
            return self._finish_demote(plan, self.pools.allocator.get_cpu_copy(plan.slots), t)

    def _finish_demote(self, plan, kv, t: float) -> int:
        if not self.tree.plan_still_valid(plan):
            return 0
        anchor_depth = self.tree.chain_tokens(plan.owner) - len(plan.tokens)
        entry = HostEntry(plan.owner, anchor_depth, plan.anchor.id, plan.tokens, kv,
                          len(plan.tokens) * self.bytes_per_token)
        self.host.put(entry, timed_ms(t))
        self.tree.drop_tail(plan)
        return len(plan.tokens)

    def host_nodes(self, preview: Callable[[Sequence[int]], str], owner: Optional[str] = None) -> list[NodeInfo]:
        """Offloaded tails as snapshot nodes (residency "host"), hanging from their anchors."""
        with self.host.lock:
            entries = list(self.host.entries.values())
        return [
            NodeInfo(id=e.node_id, parent=e.anchor_node_id if e.anchor_tokens else None, tokens=len(e.tokens),
                     depth_tokens=e.anchor_tokens + len(e.tokens), preview=preview(list(e.tokens[:16])),
                     hit_count=0, lock_count=0, last_access_age_s=0.0, residency="host",
                     owners=(e.owner,), namespace=None)
            for e in entries if owner is None or e.owner == owner
        ]
