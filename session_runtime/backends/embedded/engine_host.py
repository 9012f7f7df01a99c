"""The engine's host-tier operations: demote a waiting conversation's exclusive
chain tail to host memory, reload it before the next prefill, or discard it.

A mixin of Engine: it uses the engine's lock, tree, pools, host tier and
allocator, and keeps the engine module to the step itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from radix_ext.host_tier import EvictedTail, HostEntry, Reservation, pick_shared, tail_nodes, timed_ms
from radix_ext.tree import Namespace, NodeInfo, TailPlan


@dataclass(frozen=True)
class _Demotion:
    """A planned demotion: the tail, the owner's write-through copy of its head
    (if any, reused), and the host range the copy goes to (None when the
    write-through copy already holds the whole tail)."""

    plan: TailPlan
    reuse: Optional[HostEntry]
    res: Optional[Reservation]

    @property
    def held(self) -> int:
        return len(self.reuse.tokens) if self.reuse is not None else 0


class HostTierOps:
    def reload(self, owner: str, namespace: Namespace, prompt: list[int]) -> None:
        """Bring the owner's offloaded tail back before its next step. The copy
        runs outside the engine lock, overlapping other conversations' steps;
        the step that follows counts the tokens as host_loaded. An entry the
        prompt does not continue is dropped (recomputed). Raises PoolExhausted,
        keeping the entry."""
        with self.lock:
            entry = self._reloadable(owner, prompt)
            if entry is None:
                return
            slots = self._alloc_for(owner, entry)  # PoolExhausted leaves the entry where it was
            if slots is None:
                return
            self.host.pin(owner)  # no other demotion may drop it during the unlocked copy
        try:
            copy_ms = self._copy_in(entry, slots)
            with self.lock:
                done = self._restore(owner, namespace, prompt, entry, slots, copy_ms)
                if done is not None:
                    self._reloaded[owner] = done
        finally:
            self.host.unpin(owner)

    def _promote(self, owner: str, namespace: Namespace, prompt: list[int]) -> tuple[int, int]:
        """Inside a step (engine lock held): reload now. Returns (anchor depth,
        reloaded tokens)."""
        entry = self._reloadable(owner, prompt)
        slots = None if entry is None else self._alloc_for(owner, entry)
        if slots is None:
            return 0, 0
        return self._restore(owner, namespace, prompt, entry, slots, self._copy_in(entry, slots)) or (0, 0)

    def _share(self, owner: str, namespace: Namespace, prompt: list[int]) -> tuple[int, int]:
        """Inside a step (engine lock held): another conversation's host-only tail
        that this prompt shares at least a page further than the device tree
        holds is reloaded, for both (write-through: its owner's chain moves back
        to it, its host copy stays). Returns (first reloaded position, tokens),
        (0, 0) when nothing is shared."""
        on_device = lambda: self.tree.probe(namespace.key(prompt[: len(prompt) - 1])).device_len  # noqa: E731
        best = pick_shared(list(self.host.entries.values()), owner, (namespace.extra_key, namespace.cache_salt), prompt,
                           lambda: max(on_device(), self.tree.chain_tokens(owner)),
                           self.page_size, self.tree.chain_tokens)
        if best is None:
            return 0, 0
        entry, full, _ = best
        other = entry.owner
        slots = self._alloc_for(other, entry)
        if slots is None:
            return 0, 0
        done = self._restore(other, namespace, list(full), entry, slots, self._copy_in(entry, slots))
        if done is None:
            return 0, 0
        self.host.stats.shared_tokens += done[1]
        return done

    def _alloc_for(self, owner: str, entry: HostEntry):
        """Device slots for reloading `entry`, or None when making room (a pressure
        demotion of another waiter) dropped the entry itself: then the step
        recomputes the tail. Raises PoolExhausted, keeping the entry."""
        slots = self.alloc(len(entry.tokens))
        if self.host.peek(owner) is not entry:
            self.pools.allocator.free(slots)
            return None
        return slots

    def _copy_in(self, entry: HostEntry, slots) -> float:
        """Copy the entry into `slots`; returns the copy's milliseconds. A failed
        copy frees the slots and keeps the entry."""
        t = time.perf_counter()
        try:
            self.mover.to_device(entry.kv, slots[: len(entry.kv)])  # slots are whole pages
        except BaseException:
            with self.lock:
                self.pools.allocator.free(slots)
            raise
        return timed_ms(t)

    def _reloadable(self, owner: str, prompt: list[int]) -> Optional[HostEntry]:
        """The owner's host-only entry if the prompt continues it; a stale one is dropped."""
        entry = self.host.peek(owner)
        if entry is None or entry.on_device:
            return None
        start, end = entry.anchor_tokens, entry.anchor_tokens + len(entry.tokens)
        if self.tree.chain_tokens(owner) != start or prompt[start:end] != list(entry.tokens):
            self.host.take(owner)
            self.host.stats.lost_tokens += len(entry.tokens)
            return None
        return entry

    def _restore(self, owner, namespace: Namespace, prompt: list[int], entry: HostEntry, slots,
                 copy_ms: float) -> Optional[tuple[int, int]]:
        """Insert reloaded slots under the chain. Returns (first reloaded position,
        tokens the device did not already hold), or None when the copy went stale."""
        start, end = entry.anchor_tokens, entry.anchor_tokens + len(entry.tokens)
        if self.tree.chain_tokens(owner) != start or self.host.peek(owner) is not entry:
            self.pools.allocator.free(slots)  # the chain or the entry changed meanwhile: stale
            if self.host.peek(owner) is entry:
                self.host.take(owner)
                self.host.stats.lost_tokens += len(entry.tokens)
            return None
        prefix_len = self.tree.restore_tail(owner, namespace.key(prompt[:end]), slots)
        if prefix_len > start:  # someone cached the same tokens meanwhile
            self.pools.allocator.free(slots[: prefix_len - start])
        self.host.record_promote(entry, copy_ms)
        entry.on_device = True  # write-through: the host copy stays until it is reused or dropped
        # Tokens another chain had cached meanwhile came from the device, not the host.
        first = max(start, prefix_len)
        return first, end - first

    def demote(self, owner: str, still_waiting: Callable[[], bool] = lambda: True) -> int:
        """Copy the owner's exclusive chain tail to the host and free its device
        pages. The copy runs outside the engine lock (the chain's lock keeps the
        pages alive and cached KV is never rewritten); a step of the same owner
        in between makes it a no-op. A write-through copy of the tail's head is
        reused: only the tokens added since come from the device. `still_waiting`
        is checked under the lock before planning and before finishing: a wait
        that ended meanwhile (its step started, or the conversation was deleted)
        cancels the demotion. Returns the tokens moved off the device."""
        with self.lock:
            job = self._plan(owner) if still_waiting() else None
            if job is None:
                return 0
            self.host.pin(owner)  # other demotions must not drop the copy whose head is reused
        try:
            copy_ms = self._copy_out(job)
            with self.lock:
                if not still_waiting():
                    self._cancel(job)
                    return 0
                return self._finish_demote(job, copy_ms)
        finally:
            self.host.unpin(owner)

    def demote_locked(self, owner: str, still_waiting: Callable[[], bool] = lambda: True) -> int:
        """`demote` with the copy under the lock (called from inside a step)."""
        with self.lock:
            job = self._plan(owner) if still_waiting() else None
            if job is None:
                return 0
            return self._finish_demote(job, self._copy_out(job))

    def discard(self, owner: str, still_waiting: Callable[[], bool] = lambda: True) -> int:
        """Free the owner's exclusive chain tail without a host copy (a
        write-through one is dropped too): the next step recomputes it
        (InferCept's "discard", a baseline). Returns tokens freed."""
        with self.lock:
            old = self.host.peek(owner)
            plan = self.tree.plan_demote(owner) if still_waiting() and (old is None or old.on_device) else None
            if plan is None:  # nothing to free, or the tail is on the host already
                return 0
            tail = EvictedTail(owner, self.tree.chain_tokens(owner) - len(plan.tokens), plan.anchor.id,
                               plan.tokens, tail_nodes(plan.nodes))
            self.tree.drop_tail(plan)
            self.host.take(owner)
            self.host.record_evicted(tail)
            return len(plan.tokens)

    def release_idle(self, owner: str, still_idle: Callable[[], bool] = lambda: True) -> int:
        """Unlock an idle owner's chain that could not be demoted (the host is
        full, or nothing of it is exclusive): its pages become evictable, and its
        next step reuses what LRU has not taken. A chain already on the host is
        left as it is. Returns the tokens it held on the device."""
        with self.lock:
            entry = self.host.peek(owner)
            if not still_idle() or owner not in self.tree.chains or (entry is not None and not entry.on_device):
                return 0
            held = self.tree.chain_tokens(owner)
            self.tree.release_chain(owner)
            self.host.take(owner)
            return held

    def _plan(self, owner: str) -> Optional[_Demotion]:
        """Plan the owner's demotion and reserve its host range (which may drop
        other owners' host copies for room). None when there is nothing to do."""
        old = self.host.peek(owner)
        if old is not None and not old.on_device:
            return None  # already on the host: a second copy would replace the first
        plan = self.tree.plan_demote(owner)
        if plan is None or not self.host.fits(len(plan.tokens)):
            return None
        n = len(old.tokens) if old is not None else 0
        reuse = old if (
            old is not None and n <= len(plan.tokens)
            and old.anchor_tokens == self.tree.chain_tokens(owner) - len(plan.tokens)
            and plan.tokens[:n] == old.tokens and self.tree.path_tokens(plan.anchor) == old.prefix
        ) else None
        if reuse is not None and n == len(plan.tokens):
            return _Demotion(plan, reuse, None)
        res = self.host.reserve(owner, len(plan.tokens))
        if res is None and old is not None:  # the owner's own write-through copy is in the way
            self.host.take(owner)
            reuse, res = None, self.host.reserve(owner, len(plan.tokens))
        return None if res is None else _Demotion(plan, reuse, res)

    def _copy_out(self, job: _Demotion) -> float:
        """Fill the reserved range: the reused head from the write-through copy,
        the rest from the device. Returns the copy's milliseconds. A failed copy
        cancels the reservation."""
        if job.res is None:
            return 0.0
        t, held = time.perf_counter(), job.held
        try:
            if held:
                job.res.kv.narrow(0, held).copy_(job.reuse.kv)
            self.mover.to_host(job.plan.slots[held:], job.res.kv.narrow(held, len(job.plan.slots) - held))
        except BaseException:
            self.host.cancel(job.res)
            raise
        return timed_ms(t)

    def _cancel(self, job: _Demotion) -> None:
        if job.res is not None:
            self.host.cancel(job.res)

    def _finish_demote(self, job: _Demotion, copy_ms: float) -> int:
        plan, reuse, res = job.plan, job.reuse, job.res
        if not self.tree.plan_still_valid(plan) or (reuse is not None and self.host.peek(plan.owner) is not reuse):
            self._cancel(job)  # the tail changed, or the reused copy was dropped (its range may be reused)
            return 0
        anchor_depth = self.tree.chain_tokens(plan.owner) - len(plan.tokens)
        start, kv = (reuse.start, reuse.kv) if res is None else (res.start, res.kv)
        entry = HostEntry(plan.owner, anchor_depth, plan.anchor.id, plan.tokens, start, kv,
                          prefix=self.tree.path_tokens(plan.anchor), nodes=tail_nodes(plan.nodes),
                          namespace=(plan.tail.key.extra_key, plan.tail.key.cache_salt))
        self.host.commit(entry, res, copy_ms, copied_tokens=len(plan.tokens) - job.held)
        self.tree.drop_tail(plan)
        return len(plan.tokens)

    def drop_host_copy(self, owner: str) -> None:
        """Forget a write-through copy the owner will not need (its turn closed)."""
        entry = self.host.peek(owner)
        if entry is not None and entry.on_device:
            self.host.take(owner)

    def both_nodes(self) -> frozenset:
        """Ids of device nodes that also have a host copy (residency "both")."""
        out = set()
        with self.host.lock:
            entries = [e for e in self.host.entries.values() if e.on_device]
        for e in entries:
            node = self.tree.chains.get(e.owner)
            end = e.anchor_tokens + len(e.tokens)
            if node is None:
                continue
            path = self.tree.path_tokens(node)
            if path[: e.anchor_tokens] != e.prefix or path[e.anchor_tokens : end] != e.tokens:
                continue
            depth = len(path)
            while node is not self.tree.root_node and depth > e.anchor_tokens:
                if depth <= end:
                    out.add(node.id)
                depth -= len(node.key)
                node = node.parent
        return frozenset(out)

    def host_nodes(self, preview: Callable[[Sequence[int]], str], owner: Optional[str] = None) -> list[NodeInfo]:
        """The nodes of offloaded tails (residency "host") and of lost ones
        ("evicted", until the owner's next step recomputes them), with the ids
        and hit counts they had in the tree, hanging from their anchors; their
        age is the time since they left the device."""
        with self.host.lock:
            tails = [(e, "host") for e in self.host.entries.values() if not e.on_device]
            tails += [(e, "evicted") for e in self.host.evicted.values()]
        out, now = [], time.monotonic()
        for e, residency in tails:
            if (owner is not None and e.owner != owner) or self.tree.chain_tokens(e.owner) != e.anchor_tokens:
                continue
            parent, depth = (e.anchor_node_id if e.anchor_tokens else None), e.anchor_tokens
            ns = getattr(e, "namespace", None) or (None, None)  # a lost tail (EvictedTail) keeps none
            for node in e.nodes:
                offset = depth - e.anchor_tokens
                depth += node.tokens
                out.append(NodeInfo(id=node.id, parent=parent, tokens=node.tokens, depth_tokens=depth,
                                    preview=preview(list(e.tokens[offset : offset + 16])), hit_count=node.hit_count,
                                    lock_count=0, last_access_age_s=round(now - e.moved_at, 3),
                                    residency=residency, owners=(e.owner,),
                                    namespace=ns[0], cache_salt=ns[1]))
                parent = node.id
        return out
