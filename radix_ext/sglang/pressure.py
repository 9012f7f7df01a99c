"""Held chains never wedge SGLang's scheduler.

A chain is locked, so its pages are neither free nor evictable. SGLang meets a
pool that is short in two places: a request it cannot admit waits in its
queue (the admission budget counts free and evictable pages only), and a
running batch whose next decode does not fit retracts running requests (its
allocator first asks the tree to evict, `evict_for_alloc`). In both places,
before a request waits or is retracted for want of room, `make_room` relieves
the held chains that no request is using, longest idle first:

1. conversations waiting for tools that the runtime registered (offload
   `pressure`): demoted to the host tier (their next step reloads them);
2. idle chains (a closed turn): demoted, else released;
3. every other chain without a request in flight: a tool wait under offload
   `never`, `ttl` or `always` before its due time: demoted, else released;
4. registered tool waits that could not be demoted: released.

A released chain's nodes become evictable and its private partial page is
freed at once; the conversation's next step prefills what LRU took and counts
it (`evicted`). Every rank runs the same decisions in the same order (the
orders are of events every rank sees alike).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)


def busy_owners(scheduler: Any) -> set[str]:
    """Conversations with a request in the scheduler (queued or running)."""
    if scheduler is None:
        return set()
    running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or ()
    queued = getattr(scheduler, "waiting_queue", None) or ()
    return {o for o in (getattr(r, "session_id", None) for r in (*running, *queued)) if o}


def make_room(cache, enough: Callable[[], bool], busy: Iterable[str] = ()) -> int:
    """Relieve held chains (module doc) until `enough()`. Returns how many."""
    busy = set(busy)
    relieved = _make_room(cache, enough, busy)
    logger.info("pressure: relieved %d held chains (%s); %s", relieved, "enough room" if enough() else
                "still short", f"{len(cache.chains)} held, {len(busy)} in flight")
    return relieved


def _make_room(cache, enough: Callable[[], bool], busy: set) -> int:
    relieved = 0

    def free_of(owners) -> list[str]:
        return [o for o in owners if o in cache.chains and o not in busy]

    waiting = free_of(sorted(cache.offload.waiting, key=cache.offload.waiting.get))
    for owner in waiting:  # 1
        if enough():
            return relieved
        if cache.offload.demote(cache, owner):
            cache.idle.stats["pressure_demoted"] += 1
            relieved += 1
    for owner in free_of(sorted(cache.idle.since, key=cache.idle.since.get)):  # 2
        if enough():
            return relieved
        cache.idle.retire(cache, owner, "pressure")
        relieved += 1
    others = free_of(sorted((o for o in cache.chains if o not in cache.offload.waiting
                             and o not in cache.idle.since), key=lambda o: cache.used_at.get(o, 0.0)))
    for owner in others + [o for o in waiting if o in cache.offload.waiting]:  # 3, 4
        if enough():
            return relieved
        cache.offload.waiting.pop(owner, None)
        cache.idle.retire(cache, owner, "pressure")
        relieved += 1
    return relieved


def touch(cache, owner: str) -> None:
    """The owner's chain was just held by a step: it is the most recently used."""
    cache.used_at[owner] = time.monotonic()
