"""Host tier: KV of waiting conversations kept in host memory.

A conversation's exclusive chain tail (nodes no other chain needs) is copied to
the host with SGLang's `get_cpu_copy` and its device pages are freed; the copy
comes back with `load_cpu_copy` before the conversation's next prefill.
Both calls move the pool's own bytes, so a reload is bit-identical.

HiCache's host pools (`memory_pool_host.py`) need CUDA transfer kernels; these
two calls run on CPU and GPU alike. Pinned buffers and copy streams on a GPU
are not done yet: on CUDA the copies are synchronous device<->pageable copies.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class HostEntry:
    """One conversation's offloaded tail: tokens [anchor, anchor + len(tokens))."""

    owner: str
    anchor_tokens: int  # depth of the device node the tail hangs from
    anchor_node_id: int
    tokens: array
    kv: object  # SGLang CPU copy: per layer, per chunk, [k, v]
    nbytes: int
    prefix: array = field(default_factory=lambda: array("q"))  # the anchor path's tokens
    # Write-through: after a reload the copy stays, so the tail is on the device
    # and the host ("both") and a later demotion copies only what was added.
    on_device: bool = False
    node_id: int = 0  # stable negative id in tree snapshots, set by HostTier.put


@dataclass
class TransferStats:
    demoted_tokens: int = 0
    demoted_bytes: int = 0
    demote_ms: float = 0.0
    promoted_tokens: int = 0
    promoted_bytes: int = 0
    promote_ms: float = 0.0
    lost_tokens: int = 0  # dropped from the host for room: recomputed on resume


@dataclass
class HostTier:
    """A bounded map owner -> HostEntry, least recently stored dropped first."""

    capacity_tokens: int
    bytes_per_token: int
    entries: "OrderedDict[str, HostEntry]" = field(default_factory=OrderedDict)
    stats: TransferStats = field(default_factory=TransferStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _stored: int = 0
    _used: int = 0  # tokens held, kept with the entries (readable without the lock)

    @property
    def used_tokens(self) -> int:
        return self._used

    def fits(self, tokens: int) -> bool:
        return tokens <= self.capacity_tokens

    def put(self, entry: HostEntry, copy_ms: float, copied_tokens: Optional[int] = None) -> list[str]:
        """Store `entry` (replacing the owner's previous one), dropping the oldest
        entries for room. Returns the owners whose KV was lost (they will
        recompute). Requires fits(len(entry.tokens))."""
        assert self.fits(len(entry.tokens)), "entry larger than the host tier"
        lost = []
        with self.lock:
            replaced = self.entries.pop(entry.owner, None)
            if replaced is not None:
                self._used -= len(replaced.tokens)
            while self._used + len(entry.tokens) > self.capacity_tokens:
                owner, old = self.entries.popitem(last=False)
                self._used -= len(old.tokens)
                if not old.on_device:  # a write-through copy is not the only one
                    self.stats.lost_tokens += len(old.tokens)
                    lost.append(owner)
            self._used += len(entry.tokens)
            self._stored += 1
            entry.node_id = -self._stored
            self.entries[entry.owner] = entry
            copied = len(entry.tokens) if copied_tokens is None else copied_tokens
            self.stats.demoted_tokens += copied
            self.stats.demoted_bytes += entry.nbytes * copied // max(len(entry.tokens), 1)
            self.stats.demote_ms += copy_ms
        return lost

    def take(self, owner: str) -> Optional[HostEntry]:
        with self.lock:
            entry = self.entries.pop(owner, None)
            if entry is not None:
                self._used -= len(entry.tokens)
            return entry

    def peek(self, owner: str) -> Optional[HostEntry]:
        with self.lock:
            return self.entries.get(owner)

    def record_promote(self, entry: HostEntry, copy_ms: float) -> None:
        with self.lock:
            self.stats.promoted_tokens += len(entry.tokens)
            self.stats.promoted_bytes += entry.nbytes
            self.stats.promote_ms += copy_ms

    def bytes_of(self, owner: str) -> int:
        entry = self.peek(owner)
        return 0 if entry is None else entry.nbytes


def timed_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def concat_copies(a: list, b: list, chunk: int) -> list:
    """Join two SGLang CPU copies (per layer, per chunk of `chunk` tokens, [k, v])
    into one with the same chunking, as `load_cpu_copy` expects."""
    import torch

    out = []
    for la, lb in zip(a, b):
        k = torch.cat([c[0] for c in la] + [c[0] for c in lb])
        v = torch.cat([c[1] for c in la] + [c[1] for c in lb])
        out.append([[k[i : i + chunk], v[i : i + chunk]] for i in range(0, len(k), chunk)])
    return out
