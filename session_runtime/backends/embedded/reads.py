"""What operators read of the embedded engine (/metrics, /debug/tree, a
conversation's GET) without waiting on its steps for long: `LastReads` takes
the engine's lock when it comes within READ_WAIT_S (a step hands it over after
every token), else answers with the last value read under it, a consistent
snapshot from moments ago; `samples` are the engine's /metrics figures."""

from __future__ import annotations

import collections
from typing import Callable

from session_runtime.metrics import Sample, counter, gauge


class LastReads:
    READ_WAIT_S = 0.05

    def __init__(self, lock):
        self.lock = lock
        self._last: collections.OrderedDict[tuple, object] = collections.OrderedDict()

    def get(self, key: tuple, compute: Callable[[], object], default: object = None):
        """compute() under the lock, or the last value read for `key` (else `default`)."""
        if self.lock.acquire(timeout=self.READ_WAIT_S):
            try:
                value = compute()
            finally:
                self.lock.release()
            self._last[key] = value
            self._last.move_to_end(key)
            while len(self._last) > 256:
                self._last.popitem(last=False)
            return value
        return self._last.get(key, default)


def samples(pools, tree, host) -> list[Sample]:
    """The engine's pool, tree and host-tier figures for /metrics."""
    moved = host.stats
    return [
        gauge("pool_capacity_tokens", pools.capacity, "KV slots of the device pool"),
        gauge("pool_free_tokens", pools.allocator.available_size(), "Free KV slots of the device pool"),
        gauge("tree_locked_tokens", tree.protected_size(), "Tree tokens locked by conversations"),
        gauge("tree_evictable_tokens", tree.evictable_size(), "Tree tokens no chain locks: evictable"),
        gauge("tree_private_tokens", tree.private_tokens(),
              "KV slots held by chains' private partial pages (whole pages)"),
        gauge("host_capacity_tokens", host.capacity_tokens, "Tokens the host tier can hold"),
        gauge("host_used_tokens", host.used_tokens, "Tokens the host tier holds"),
        counter("offload_demoted_tokens_total", moved.demoted_tokens, "Tokens copied from the device to the host"),
        counter("offload_demoted_bytes_total", moved.demoted_bytes, "KV bytes copied from the device to the host"),
        counter("offload_demote_seconds_total", moved.demote_ms / 1e3, "Time spent copying KV to the host"),
        counter("offload_promoted_tokens_total", moved.promoted_tokens, "Tokens copied from the host to the device"),
        counter("offload_promoted_bytes_total", moved.promoted_bytes, "KV bytes copied from the host to the device"),
        counter("offload_promote_seconds_total", moved.promote_ms / 1e3, "Time spent copying KV to the device"),
        counter("offload_lost_tokens_total", moved.lost_tokens,
                "Host tokens dropped for room (recomputed when their conversation resumes)"),
        counter("offload_shared_tokens_total", moved.shared_tokens,
                "Host tokens reloaded for another conversation whose prompt shares them"),
    ]
