"""Tool-wait offload inside SGLang's scheduler.

While a conversation waits for tool results, its exclusive chain tail (the
nodes only its chain holds, and its private page) can move from the
scheduler's own KV pool to a host arena in the scheduler process and free its
device pages; `promote` brings it back into fresh pages before the next
request's prefill. The bytes are the pool's own (`kv_copy.KVMover`), so a
round trip is bit-identical. Everything runs on the scheduler thread, between
batches (control commands and the per-iteration hook), so no request of the
owner is in flight while its tail moves: the runtime demotes only during a
tool wait, and a request the owner already queued blocks a demotion.

Under pressure (a waiting request that cannot be admitted while nothing runs),
conversations that wait for tools are demoted, oldest wait first, before any
idle chain is released (`idle.py`).

Host-resident prefixes are shared: a request whose prompt continues another
conversation's host copy at least a page beyond what the device holds has that
copy promoted first (`share`), back under its own owner's chain, so the request
reuses it from the tree instead of prefilling it again. The owner goes back to
waiting (or idle), so pressure can move it out again.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from radix_ext.host_tier import HostEntry, HostTier, pick_shared, tail_nodes, timed_ms
from radix_ext.kv_copy import KVMover


class SchedulerHostTier:
    def __init__(self) -> None:
        self.host: Optional[HostTier] = None  # allocated by the first demotion (its size comes from the runtime)
        self.mover: Optional[KVMover] = None
        self.waiting: dict[str, float] = {}  # owners in a tool wait that pressure may demote -> since

    def ensure(self, cache, tokens: int) -> HostTier:
        if self.host is None:
            self.mover = KVMover(cache.token_to_kv_pool_allocator.get_kvcache())
            self.host = HostTier(self.mover.empty(tokens))
        return self.host

    def demote(self, cache, owner: str, idle: bool = False) -> int:
        """Copy the owner's exclusive tail to the host and free its device pages
        (`idle`: it is an idle chain, not a tool wait). Returns the tokens moved
        (0: nothing exclusive, no room, or a request of the owner is queued)."""
        self.waiting.pop(owner, None)
        if self.host is None or owner in cache._offers or self.host.peek(owner) is not None:
            return 0
        plan = cache.plan_demote(owner)
        if plan is None or not self.host.fits(len(plan.tokens)):
            return 0
        res = self.host.reserve(owner, len(plan.tokens))
        if res is None:
            return 0
        t = time.perf_counter()
        try:
            self.mover.to_host(plan.slots, res.kv)
        except BaseException:
            self.host.cancel(res)
            raise
        anchor = cache.chain_tokens(owner) - len(plan.tokens)
        entry = HostEntry(owner, anchor, plan.anchor.id, plan.tokens, res.start, res.kv,
                          prefix=cache.path_tokens(plan.anchor), nodes=tail_nodes(plan.nodes),
                          namespace=(plan.tail.key.extra_key, plan.tail.key.cache_salt), idle=idle)
        self.host.commit(entry, res, timed_ms(t), copied_tokens=len(plan.tokens))
        cache.drop_tail(plan)
        return len(plan.tokens)

    def promote(self, cache, owner: str, key) -> dict:
        """Reload the owner's tail if `key` (the next prompt) continues it.
        Returns {"anchor", "tokens"}: the reloaded span the next request reuses
        from the host (tokens 0 when nothing came back). A stale entry is dropped;
        one that does not fit yet stays (the request then recomputes it)."""
        self.waiting.pop(owner, None)
        entry = None if self.host is None else self.host.peek(owner)
        if entry is None:
            return {"anchor": 0, "tokens": 0}
        start, end = entry.anchor_tokens, entry.anchor_tokens + len(entry.tokens)
        if (owner not in cache.chains or cache.chain_tokens(owner) != start
                or list(key.token_ids[start:end]) != list(entry.tokens)):  # its chain is gone or moved: stale
            self.host.take(owner)
            self.host.stats.lost_tokens += len(entry.tokens)
            return {"anchor": 0, "tokens": 0}
        slots = cache.alloc_pages(len(entry.tokens))
        if slots is None:  # idle chains make room first, as for admission
            cache.idle.make_room(cache, -(-len(entry.tokens) // cache.page_size) * cache.page_size, exclude=owner)
            slots = cache.alloc_pages(len(entry.tokens))
        if slots is None:
            return {"anchor": 0, "tokens": 0}
        t = time.perf_counter()
        try:
            self.mover.to_device(entry.kv, slots[: len(entry.tokens)])
            prefix_len = cache.restore_tail(owner, key[:end], slots)
        except BaseException:  # nothing it allocated may leak: SGLang's idle check would stop the server
            cache.token_to_kv_pool_allocator.free(slots)
            raise
        if prefix_len > start:  # someone cached the same tokens meanwhile
            cache.token_to_kv_pool_allocator.free(slots[: prefix_len - start])
        self.host.record_promote(entry, timed_ms(t))
        self.host.take(owner)
        first = max(start, prefix_len)
        return {"anchor": first, "tokens": end - first}

    def share(self, cache, owner: str, key) -> dict:
        """Promote another conversation's host copy that `key` (this owner's next
        prompt) shares at least a page beyond what the device gives it. Returns
        {"anchor", "tokens"}: the page-aligned shared span this request reuses
        from the host, tokens 0 when none."""
        none = {"anchor": 0, "tokens": 0}
        if self.host is None or not self.host.entries:
            return none
        best = pick_shared(list(self.host.entries.values()), owner, (key.extra_key, key.cache_salt), key.token_ids,
                           lambda: max(cache.probe(key[: len(key) - 1]).device_len, cache.chain_tokens(owner)),
                           cache.page_size, cache.chain_tokens)
        if best is None:
            return none
        entry, full, shared = best
        got = self.promote(cache, entry.owner, type(key)(full, extra_key=key.extra_key, cache_salt=key.cache_salt))
        if not got["tokens"]:
            return none
        if entry.idle:  # back to what it was: pressure may move it out again
            cache.idle.mark(entry.owner, cache.idle.ttl_s)
        else:
            self.waiting[entry.owner] = entry.moved_at
        # Reuse across conversations is page-aligned, as SGLang's match is.
        reused = shared // cache.page_size * cache.page_size
        tokens = max(0, min(reused, got["anchor"] + got["tokens"]) - got["anchor"])
        self.host.stats.shared_tokens += tokens
        return {"anchor": got["anchor"], "tokens": tokens}

    def nodes(self, cache, preview: Callable, owner: Optional[str] = None, preview_tokens: int = 16) -> list:
        """The tree nodes of host-resident tails (residency "host"), as the tree
        had them when they left the device (ids, sizes, hits), hanging from their
        anchors: a snapshot lists them after the device nodes (parents first).
        A tail whose chain no longer hangs at its anchor (stale, dropped at the
        next promote) is left out. Read-only."""
        if self.host is None:
            return []
        from radix_ext.tree import NodeInfo

        with self.host.lock:
            entries = [e for e in self.host.entries.values()
                       if not e.on_device and (owner is None or e.owner == owner)]
        out, now = [], time.monotonic()
        for e in entries:
            if e.owner not in cache.chains or cache.chain_tokens(e.owner) != e.anchor_tokens:
                continue
            parent, depth = (e.anchor_node_id if e.anchor_tokens else None), e.anchor_tokens
            for node in e.nodes:
                offset = depth - e.anchor_tokens
                depth += node.tokens
                out.append(NodeInfo(id=node.id, parent=parent, tokens=node.tokens, depth_tokens=depth,
                                    preview=preview(list(e.tokens[offset : offset + min(node.tokens, preview_tokens)])),
                                    hit_count=node.hit_count, lock_count=0,
                                    last_access_age_s=round(now - e.moved_at, 3), residency="host",
                                    owners=(e.owner,), namespace=e.namespace[0], cache_salt=e.namespace[1]))
                parent = node.id
        return out

    def forget(self, owner: str) -> None:
        self.waiting.pop(owner, None)
        if self.host is not None:
            self.host.take(owner)

    def holds(self, owner: str) -> bool:
        """Is a copy of the owner's tail on the host?"""
        return self.host is not None and self.host.peek(owner) is not None

    def bytes_of(self, owner: str) -> int:
        return 0 if self.host is None else self.host.bytes_of(owner)

    def stats(self) -> dict[str, Any]:
        if self.host is None:
            return {"capacity_tokens": 0, "used_tokens": 0}
        import dataclasses

        return {"capacity_tokens": self.host.capacity_tokens, "used_tokens": self.host.used_tokens,
                **dataclasses.asdict(self.host.stats)}
