"""Host tier: KV of waiting conversations kept in host memory.

A conversation's exclusive chain tail (nodes no other chain needs) is copied to
the host by `kv_copy.KVMover` and its device pages are freed; the copy comes
back before the conversation's next prefill. The bytes are the pool's own, so
a reload is bit-identical.

The host pool is one arena per K and V, `[layers, capacity, kv_heads,
head_dim]`, allocated once (pinned on CUDA, as HiCache's host pools are): its
capacity is the tier's, and no copy allocates host memory. Each tail takes one
contiguous range of it (first fit), so a copy moves each layer in one transfer.
Room for a demotion is reserved before the copy; making room drops other
owners' least recently stored tails (they are recomputed on resume).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from radix_ext.kv_copy import HostKV


@dataclass(frozen=True)
class TailNode:
    """A tree node of a tail that left the device: its id, size and hits then."""

    id: int
    tokens: int
    hit_count: int


@dataclass
class HostEntry:
    """One conversation's offloaded tail: tokens [anchor, anchor + len(tokens)),
    held in the arena range [start, start + len(tokens))."""

    owner: str
    anchor_tokens: int  # depth of the device node the tail hangs from
    anchor_node_id: int
    tokens: array
    start: int
    kv: HostKV  # views of the arena range
    prefix: array = field(default_factory=lambda: array("q"))  # the anchor path's tokens
    # Write-through: after a reload the copy stays, so the tail is on the device
    # and the host ("both") and a later demotion copies only what was added.
    on_device: bool = False
    nodes: tuple[TailNode, ...] = ()  # the tail's tree nodes, top-down, as snapshots show them
    moved_at: float = field(default_factory=time.monotonic)  # when it left the device
    namespace: tuple = (None, None)  # (extra_key, cache_salt) of its tree keys: who may share it
    idle: bool = False  # left the device as an idle chain, not during a tool wait (SGLang's scheduler)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


@dataclass(frozen=True)
class Reservation:
    """An arena range held for one demotion until it commits or is cancelled."""

    start: int
    kv: HostKV


@dataclass(frozen=True)
class EvictedTail:
    """A waiting conversation's tail whose KV is gone from the device and the
    host (dropped for room, or discarded): its next step recomputes it."""

    owner: str
    anchor_tokens: int
    anchor_node_id: int
    tokens: array
    nodes: tuple[TailNode, ...]
    moved_at: float = field(default_factory=time.monotonic)  # when it was lost


@dataclass
class TransferStats:
    demoted_tokens: int = 0
    demoted_bytes: int = 0
    demote_ms: float = 0.0
    promoted_tokens: int = 0
    promoted_bytes: int = 0
    promote_ms: float = 0.0
    lost_tokens: int = 0  # dropped from the host for room: recomputed on resume
    shared_tokens: int = 0  # reloaded for another conversation whose prompt shares them


class Ranges:
    """Free ranges of [0, capacity), first fit, merged on release."""

    def __init__(self, capacity: int):
        self.free: list[list[int]] = [[0, capacity]] if capacity else []  # [start, length], by start

    def alloc(self, n: int) -> Optional[int]:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = [start + n, length - n]
                return start
        return None

    def copy(self) -> "Ranges":
        out = Ranges(0)
        out.free = [list(r) for r in self.free]
        return out

    def release(self, start: int, n: int) -> None:
        i = next((i for i, r in enumerate(self.free) if r[0] > start), len(self.free))
        self.free.insert(i, [start, n])
        if i + 1 < len(self.free) and start + n == self.free[i + 1][0]:
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == start:
            self.free[i - 1][1] += self.free.pop(i)[1]


class HostTier:
    """Owner -> HostEntry over a bounded arena; least recently stored dropped first."""

    def __init__(self, arena: HostKV):
        self.arena = arena
        self.capacity_tokens = len(arena)
        self.entries: "OrderedDict[str, HostEntry]" = OrderedDict()
        self.evicted: dict[str, EvictedTail] = {}  # owner -> its lost tail
        self.stats = TransferStats()
        self.lock = threading.Lock()
        self._ranges = Ranges(self.capacity_tokens)
        self._reserved: dict[int, int] = {}  # start -> length of uncommitted reservations
        self._pins: dict[str, int] = {}  # owners whose entry is being read outside the engine lock
        self._used = 0  # tokens held by entries and reservations (readable without the lock)

    @property
    def used_tokens(self) -> int:
        return self._used

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.capacity_tokens

    def reserve(self, owner: str, n: int) -> Optional[Reservation]:
        """An arena range for `n` tokens of `owner`'s tail. Makes room by dropping
        other owners' least recently stored entries (their tails are lost), never
        the owner's own nor a pinned one, and only when that does make room:
        None, with nothing dropped, when it cannot."""
        if not self.fits(n):
            return None
        with self.lock:
            start = self._ranges.alloc(n)
            if start is None:
                victims = self._victims(owner, n)
                if victims is None:
                    return None
                for victim in victims:
                    self._drop(victim)
                start = self._ranges.alloc(n)
            self._reserved[start] = n
            self._used += n
            return Reservation(start, self.arena.narrow(start, n))

    def _victims(self, owner: str, n: int) -> Optional[list[str]]:
        """The shortest least-recently-stored run of droppable entries whose
        ranges, freed, leave a free range of `n`; None if none does."""
        trial, victims = self._ranges.copy(), []
        for other, entry in self.entries.items():
            if other == owner or self._pins.get(other):
                continue
            victims.append(other)
            trial.release(entry.start, len(entry.tokens))
            if trial.alloc(n) is not None:
                return victims
        return None

    def pin(self, owner: str) -> None:
        """Keep the owner's entry from being dropped for room while it is read
        outside the engine lock (a reload, or a demotion reusing its head)."""
        with self.lock:
            self._pins[owner] = self._pins.get(owner, 0) + 1

    def unpin(self, owner: str) -> None:
        with self.lock:
            self._pins[owner] -= 1
            if not self._pins[owner]:
                del self._pins[owner]

    def cancel(self, res: Reservation) -> None:
        with self.lock:
            self._unreserve(res)
            self._ranges.release(res.start, len(res.kv))

    def commit(self, entry: HostEntry, res: Optional[Reservation], copy_ms: float, copied_tokens: int) -> None:
        """Store `entry`, held in `res` (or, with None, in the owner's current
        entry's range), replacing the owner's current entry."""
        with self.lock:
            replaced = self.entries.pop(entry.owner, None)
            if replaced is not None and replaced.start != entry.start:
                self._free(replaced)
            elif replaced is not None:
                self._used -= len(replaced.tokens)
            if res is not None:
                self._unreserve(res)
            self._used += len(entry.tokens)
            self.entries[entry.owner] = entry
            self.evicted.pop(entry.owner, None)
            self.stats.demoted_tokens += copied_tokens
            self.stats.demoted_bytes += entry.nbytes * copied_tokens // max(len(entry.tokens), 1)
            self.stats.demote_ms += copy_ms

    def record_evicted(self, tail: EvictedTail) -> None:
        """The owner's tail was freed without a host copy (discarded)."""
        with self.lock:
            self.stats.lost_tokens += len(tail.tokens)
            self.evicted[tail.owner] = tail

    def forget_evicted(self, owner: str) -> None:
        """The owner's next step ran (it recomputed the tail), or it is gone."""
        with self.lock:
            self.evicted.pop(owner, None)

    def take(self, owner: str) -> Optional[HostEntry]:
        """Remove the owner's entry and free its range (its views must not be read after)."""
        with self.lock:
            entry = self.entries.pop(owner, None)
            if entry is not None:
                self._free(entry)
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

    def check(self) -> None:
        """Assert that entries, reservations and free ranges tile the arena."""
        with self.lock:
            spans = sorted([(e.start, len(e.tokens)) for e in self.entries.values()]
                           + list(self._reserved.items()) + [tuple(r) for r in self._ranges.free])
            pos = 0
            for start, length in spans:
                assert start == pos, f"host arena: range at {start}, expected {pos}"
                pos += length
            assert pos == self.capacity_tokens, f"host arena ranges cover {pos} of {self.capacity_tokens}"
            held = sum(len(e.tokens) for e in self.entries.values()) + sum(self._reserved.values())
            assert held == self._used, f"host tier counts {self._used} tokens, holds {held}"

    def _drop(self, owner: str) -> None:
        old = self.entries.pop(owner)
        self._free(old)
        if not old.on_device:  # a write-through copy is not the only one
            self.stats.lost_tokens += len(old.tokens)
            self.evicted[owner] = EvictedTail(owner, old.anchor_tokens, old.anchor_node_id, old.tokens, old.nodes)

    def _free(self, entry: HostEntry) -> None:
        self._used -= len(entry.tokens)
        self._ranges.release(entry.start, len(entry.tokens))

    def _unreserve(self, res: Reservation) -> None:
        del self._reserved[res.start]
        self._used -= len(res.kv)


def timed_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def tail_nodes(nodes) -> tuple[TailNode, ...]:
    """Snapshots of a demoted tail's tree nodes (a `TailPlan`'s, top-down)."""
    return tuple(TailNode(n.id, len(n.key), n.hit_count) for n in nodes)


def pick_shared(entries, owner: str, namespace: tuple, prompt, have: Callable[[], int], page_size: int,
                chain_tokens) -> Optional[tuple[HostEntry, array, int]]:
    """Host-prefix sharing: among other owners' host-only entries in `namespace`
    whose chain still hangs at the entry's anchor, the one `prompt` shares
    furthest, at least a page beyond `have()` (what the device already gives the
    prompt; called only when some entry is a candidate, so the common case reads
    nothing). The last prompt token is always computed. Returns (entry, the
    entry's full tokens from the root, shared length) or None. Reads only its
    arguments (`chain_tokens(owner)` gives a chain's length)."""
    candidates = [e for e in entries if e.owner != owner and not e.on_device and e.namespace == namespace]
    if not candidates:
        return None
    limit = len(prompt) - 1
    best, best_len = None, have() + page_size - 1
    for entry in candidates:
        end = entry.anchor_tokens + len(entry.tokens)
        if end <= best_len or chain_tokens(entry.owner) != entry.anchor_tokens:
            continue
        full = entry.prefix + entry.tokens
        shared = common_prefix(full, prompt, min(end, limit))
        if shared > best_len and shared > entry.anchor_tokens:
            best, best_len = (entry, full, shared), shared
    return best


def common_prefix(a, b, limit: int) -> int:
    """Common prefix length of two token sequences, at most `limit` (C-speed compares)."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[0] != b[0]:
        return 0
    lo, hi = 0, n  # a[:lo] == b[:lo]; binary search on slice equality
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo

