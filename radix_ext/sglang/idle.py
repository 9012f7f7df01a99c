"""Idle chains inside SGLang's scheduler: retired after a TTL, and first to go
when a waiting request cannot be admitted.

A conversation whose turn closed is idle until its next request. SGLang queues
a request that does not fit instead of refusing it, and its admission budget
counts only free and evictable pages: chains are locked, so idle ones could
keep a new conversation waiting forever. Once per scheduler iteration (the
control hook), `retire_due` retires idle chains past the TTL (demoted to the
host tier, else released: their pages become evictable; the next turn
rebuilds what LRU took); under pressure `pressure.make_room` retires them.
"""

from __future__ import annotations

import time
from typing import Any, Optional


class IdleChains:
    def __init__(self) -> None:
        # owner -> when its turn closed, in that order (a mark moves the owner to
        # the end): the due ones are a prefix, found without a sort per iteration
        self.since: dict[str, float] = {}
        self.ttl_s = 0.0  # 0: retire only under pressure
        self.stats = {"ttl_released": 0, "pressure_released": 0, "ttl_demoted": 0, "pressure_demoted": 0}

    def mark(self, owner: str, ttl_s: float, now: Optional[float] = None) -> None:
        at = time.monotonic() if now is None else now
        self.since.pop(owner, None)
        late = next(reversed(self.since.values()), at) > at  # only a caller's own clock does that
        self.since[owner] = at
        if late:
            self.since = dict(sorted(self.since.items(), key=lambda kv: kv[1]))
        self.ttl_s = ttl_s

    def active(self, owner: str) -> None:
        """The owner has a request again (or no chain): not idle."""
        self.since.pop(owner, None)

    def retire_due(self, cache, now: Optional[float] = None) -> int:
        """Retire idle chains past the TTL (pressure is pressure.make_room's). Returns how many."""
        if not self.since or self.ttl_s <= 0:
            return 0
        now = time.monotonic() if now is None else now
        due = []
        for owner, since in self.since.items():  # oldest first
            if now - since < self.ttl_s:
                break
            due.append(owner)
        for owner in due:
            self.retire(cache, owner, "ttl")
        return len(due)

    def make_room(self, cache, tokens: int, exclude: str) -> None:
        """Retire idle chains, oldest first, until `tokens` slots are free or
        evictable (a promotion needs them now)."""
        alloc = cache.token_to_kv_pool_allocator
        for owner in list(self.since):  # oldest first
            if alloc.available_size() + cache.evictable_size() >= tokens:
                return
            if owner != exclude:
                self.retire(cache, owner, "pressure")

    def retire(self, cache, owner: str, why: str) -> None:
        """Demote the owner's chain to the host tier, or release it to the LRU."""
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
    # SGLang admits a request when input + min(max_new, CLIP) + a page of overhead
    # is strictly below free + evictable (PrefillAdder.add_one_req); one page more
    # here, so that what this calls room is room there too.
    need = len(getattr(head, "origin_input_ids", ()) or ()) + _max_new(head) + 2 * cache.page_size + 1
    room = cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size()
    return room < need


CLIP_MAX_NEW = 4096  # SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION default


def _max_new(req: Any) -> int:
    params = getattr(req, "sampling_params", None)
    remaining = int(getattr(params, "max_new_tokens", 0) or 0) - len(getattr(req, "output_ids", ()) or ())
    return min(max(remaining, 0), CLIP_MAX_NEW)
