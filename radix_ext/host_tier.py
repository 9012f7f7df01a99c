"""Host tier: KV of waiting conversations kept in host memory.

A conversation's exclusive chain tail (nodes no other chain needs) is copied to
the host by `kv_copy.KVMover` (pinned buffers and a copy stream on CUDA) and its
device pages are freed; the copy comes back before the conversation's next
prefill. The bytes are the pool's own, so a reload is bit-identical.

HiCache's host pools (`memory_pool_host.py`) need CUDA transfer kernels and
copy between fixed host pages; here each tail is one host buffer, held until
the tier needs its room (least recently stored first).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from radix_ext.kv_copy import HostKV


@dataclass
class HostEntry:
    """One conversation's offloaded tail: tokens [anchor, anchor + len(tokens))."""

    owner: str
    anchor_tokens: int  # depth of the device node the tail hangs from
    anchor_node_id: int
    tokens: array
    kv: HostKV
    prefix: array = field(default_factory=lambda: array("q"))  # the anchor path's tokens
    # Write-through: after a reload the copy stays, so the tail is on the device
    # and the host ("both") and a later demotion copies only what was added.
    on_device: bool = False
    node_id: int = 0  # stable negative id in tree snapshots, set by HostTier.put

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


@dataclass(frozen=True)
class EvictedTail:
    """A waiting conversation's tail whose KV is gone from the device and the
    host (dropped for room, or discarded): its next step recomputes it."""

    owner: str
    anchor_tokens: int
    anchor_node_id: int
    tokens: array
    node_id: int


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
    entries: "OrderedDict[str, HostEntry]" = field(default_factory=OrderedDict)
    stats: TransferStats = field(default_factory=TransferStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    evicted: dict[str, EvictedTail] = field(default_factory=dict)  # owner -> its lost tail
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
                    self._evict(owner, old.anchor_tokens, old.anchor_node_id, old.tokens)
                    lost.append(owner)
            self._used += len(entry.tokens)
            entry.node_id = self._next_id()
            self.entries[entry.owner] = entry
            self.evicted.pop(entry.owner, None)
            copied = len(entry.tokens) if copied_tokens is None else copied_tokens
            self.stats.demoted_tokens += copied
            self.stats.demoted_bytes += entry.nbytes * copied // max(len(entry.tokens), 1)
            self.stats.demote_ms += copy_ms
        return lost

    def record_evicted(self, owner: str, anchor_tokens: int, anchor_node_id: int, tokens: array) -> None:
        """The owner's tail was freed without a host copy (discarded)."""
        with self.lock:
            self.stats.lost_tokens += len(tokens)
            self._evict(owner, anchor_tokens, anchor_node_id, tokens)

    def forget_evicted(self, owner: str) -> None:
        """The owner's next step ran (it recomputed the tail), or it is gone."""
        with self.lock:
            self.evicted.pop(owner, None)

    def _evict(self, owner: str, anchor_tokens: int, anchor_node_id: int, tokens: array) -> None:
        self.evicted[owner] = EvictedTail(owner, anchor_tokens, anchor_node_id, tokens, self._next_id())

    def _next_id(self) -> int:
        self._stored += 1
        return -self._stored

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

