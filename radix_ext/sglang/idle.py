"""Idle chains inside SGLang's scheduler: retired after a TTL, and first to go
when a waiting request cannot be admitted.

A conversation whose turn closed is idle until its next request. SGLang queues
a request that does not fit instead of refusing it, and its admission budget
counts only free and evictable pages: chains are locked, so idle ones could
keep a new conversation waiting forever. Once per scheduler iteration (the
control hook), `relieve` releases idle chains (their pages become evictable;
the next turn rebuilds what LRU took) that are past the TTL, or, oldest
first, while the head of the waiting queue cannot fit and nothing runs that
would free pages by finishing.
"""

from __future__ import annotations

import time
from typing import Any, Optional


class IdleChains:
    def __init__(self) -> None:
        self.since: dict[str, float] = {}  # owner -> when its turn closed
        self.ttl_s = 0.0  # 0: retire only under pressure
        self.stats = {"ttl_released": 0, "pressure_released": 0, "ttl_demoted": 0, "pressure_demoted": 0}

    def mark(self, owner: str, ttl_s: float, now: Optional[float] = None) -> None:
        self.since[owner] = time.monotonic() if now is None else now
        self.ttl_s = ttl_s

    def active(self, owner: str) -> None:
        """The owner has a request again (or no chain): not idle."""
        self.since.pop(owner, None)

    def relieve(self, cache, scheduler: Any, now: Optional[float] = None) -> int:
        """Release idle chains past the TTL, then under pressure. Returns how many."""
        if not self.since:
            return 0
        now = time.monotonic() if now is None else now
        released = 0
        for owner, since in sorted(self.since.items(), key=lambda kv: kv[1]):
            if self.ttl_s > 0 and now - since >= self.ttl_s:
                self._release(cache, owner, "ttl")
                released += 1
        while self.since and short(cache, scheduler):
            owner = min(self.since, key=self.since.get)
            self._release(cache, owner, "pressure")
            released += 1
        return released

    def make_room(self, cache, tokens: int, exclude: str) -> None:
        """Retire idle chains, oldest first, until `tokens` slots are free or
        evictable (a promotion needs them now)."""
        alloc = cache.token_to_kv_pool_allocator
        for owner in sorted(self.since, key=self.since.get):
            if alloc.available_size() + cache.evictable_size() >= tokens:
                return
            if owner != exclude:
                self._release(cache, owner, "pressure")

    def _release(self, cache, owner: str, why: str) -> None:
        self.since.pop(owner, None)
        if owner not in cache.chains:
            return
        if cache.offload.host is not None and cache.offload.demote(cache, owner, idle=True):
            self.stats[f"{why}_demoted"] += 1
            return
        cache.offload.forget(owner)  # a host copy hangs from the chain: it goes with it
        cache.release_chain(owner)
        self.stats[f"{why}_released"] += 1


def short(cache, scheduler: Any) -> bool:
    """Does the head of the waiting queue not fit, with nothing running that
    will free pages when it finishes?"""
    if scheduler is None:
        return False
    queue = getattr(scheduler, "waiting_queue", None) or ()
    running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or ()
    if not queue or running:
        return False
    head = queue[0]
    need = len(getattr(head, "origin_input_ids", ()) or ()) + _max_new(head) + cache.page_size
    room = cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size()
    return room < need


def _max_new(req: Any) -> int:
    params = getattr(req, "sampling_params", None)
    return int(getattr(params, "max_new_tokens", 0) or 0)
