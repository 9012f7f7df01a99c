"""SessionRadixCache: SGLang's RadixCache plus per-conversation chains.

What it adds to the parent class:
- chains: each conversation's tail node is locked, so its path is never
  evicted; `set_chain` moves the lock, `release_chain` drops it;
- `probe`: the reusable prefix of a key, logical and page-aligned, without the
  node splits and access-time updates that `match_prefix` makes;
- `snapshot`: every node with hits, locks, residency and owners, for debugging;
- `check_integrity`: pool accounting, lock counts and chain membership.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from radix_ext.pools import KVPools


@dataclass(frozen=True)
class Namespace:
    """What separates cache entries: model+tokenizer+template, and the tenant."""

    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None

    def key(self, token_ids: Sequence[int]) -> RadixKey:
        ids = token_ids if isinstance(token_ids, array) else array("q", token_ids)
        return RadixKey(ids, extra_key=self.extra_key, cache_salt=self.cache_salt)


@dataclass(frozen=True)
class ProbeResult:
    """Reusable prefix of a key, read from the tree without changing it.

    `logical_len` counts tokens matched exactly, before page alignment;
    `device_len` the page-aligned part whose device KV can be reused.
    """

    logical_len: int
    device_len: int


@dataclass(frozen=True)
class NodeInfo:
    id: int
    parent: Optional[int]
    tokens: int
    depth_tokens: int  # tokens from the root to the end of this node
    preview: str
    hit_count: int
    lock_count: int
    last_access_age_s: float
    residency: str
    owners: tuple[str, ...]
    namespace: Optional[str]


@dataclass(frozen=True)
class TailPlan:
    """A chain's exclusive tail, chosen for demotion: `nodes` (top-down) are held
    by this chain alone and hang from `anchor`."""

    owner: str
    tail: TreeNode
    anchor: TreeNode
    nodes: tuple[TreeNode, ...]
    slots: torch.Tensor
    tokens: array


class SessionRadixCache(RadixCache):
    """A RadixCache whose conversations each hold a locked chain."""

    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        self.chains: dict[str, TreeNode] = {}

    @classmethod
    def over_pools(cls, pools: KVPools) -> "SessionRadixCache":
        """A tree over the embedded engine's own pools."""
        return cls(
            CacheInitParams(
                disable=False,
                req_to_token_pool=pools.req_to_token,
                token_to_kv_pool_allocator=pools.allocator,
                page_size=pools.spec.page_size,
            )
        )

    @property
    def capacity(self) -> int:
        """Usable token slots of the KV pool (SGLang reserves page 0 for padding)."""
        alloc = self.token_to_kv_pool_allocator
        return alloc.num_pages * self.page_size if hasattr(alloc, "num_pages") else alloc.size

    # ----- chains -----------------------------------------------------------

    def set_chain(self, owner: str, node: TreeNode) -> None:
        """Lock `node` for `owner` and unlock the owner's previous tail.

        Locks the new tail before unlocking the old one, so a shared prefix is
        never evictable in between.
        """
        self.inc_lock_ref(node)
        old = self.chains.get(owner)
        if old is not None:
            self.dec_lock_ref(old)
        self.chains[owner] = node

    def release_chain(self, owner: str) -> None:
        """Unlock the owner's chain; its nodes become evictable (LRU). No-op if none."""
        old = self.chains.pop(owner, None)
        if old is not None:
            self.dec_lock_ref(old)

    def hold_prefix(self, owner: str, key: RadixKey) -> int:
        """Move `owner`'s chain to the longest cached page-aligned prefix of `key`.
        Mutates: may split a node. Returns the chain's new length in tokens."""
        node = self.match_prefix(MatchPrefixParams(key=key)).last_device_node
        self.set_chain(owner, node)
        return _depth(node)

    def path_tokens(self, node: TreeNode) -> array:
        """Token ids from the root to the end of `node`."""
        parts = []
        while node is not self.root_node:
            parts.append(node.key.token_ids)
            node = node.parent
        out = array("q")
        for part in reversed(parts):
            out.extend(part)
        return out

    def chain_tokens(self, owner: str) -> int:
        node = self.chains.get(owner)
        return 0 if node is None else _depth(node)

    def chain_slots(self, owner: str) -> torch.Tensor:
        node = self.chains.get(owner)
        return self._empty_device_indices if node is None else self.path_device_indices(node)

    # ----- host tier -------------------------------------------------------------

    def plan_demote(self, owner: str) -> Optional[TailPlan]:
        """The owner's exclusive tail: nodes locked by its chain only, with no
        other branch below them. None when there is nothing to demote. Read-only."""
        node = self.chains.get(owner)
        if node is None or node is self.root_node or node.children:
            return None
        nodes = []
        walk = node
        while walk is not self.root_node and walk.lock_ref == 1 and len(walk.children) == (1 if nodes else 0):
            nodes.append(walk)
            walk = walk.parent
        if not nodes:
            return None
        nodes.reverse()
        tokens = array("q")
        for n in nodes:
            tokens.extend(n.key.token_ids)
        return TailPlan(owner, node, walk, tuple(nodes), torch.cat([n.value for n in nodes]), tokens)

    def plan_still_valid(self, plan: TailPlan) -> bool:
        """Has nothing touched the planned tail since `plan_demote`?"""
        if self.chains.get(plan.owner) is not plan.tail or plan.nodes[0].parent is not plan.anchor:
            return False
        last = len(plan.nodes) - 1
        for i, n in enumerate(plan.nodes):
            attached = n.parent is not None and n.parent.children.get(n.key.child_key(self.page_size)) is n
            # A split inside the tail puts a new node between two planned ones.
            linked = i == 0 or n.parent is plan.nodes[i - 1]
            if not attached or not linked or n.lock_ref != 1 or len(n.children) != (0 if i == last else 1):
                return False
        return sum(len(n.key) for n in plan.nodes) == len(plan.tokens)

    def drop_tail(self, plan: TailPlan) -> None:
        """Move the chain to the anchor and delete the tail, freeing its device
        pages (their KV now lives on the host). Requires plan_still_valid(plan)."""
        self.set_chain(plan.owner, plan.anchor)
        for node in reversed(plan.nodes):
            assert not node.children, f"node {node.id} of a demoted tail is not a leaf"
            self.token_to_kv_pool_allocator.free(node.value)
            self._delete_leaf(node)
            self.kv_events.record_remove(node)

    def restore_tail(self, owner: str, key: RadixKey, slots: torch.Tensor) -> int:
        """Insert `key` (the chain's anchor path plus a reloaded tail in `slots`)
        and move the chain to its end. Returns the insert's prefix_len: reloaded
        slots below it duplicate KV already in the tree, the caller frees them."""
        anchor = self.chains[owner]
        value = torch.cat((self.path_device_indices(anchor), slots))
        node, prefix_len = self.insert_sequence(key, value)
        self.set_chain(owner, node)
        return prefix_len

    # ----- matching ---------------------------------------------------------

    def match_and_lock(self, key: RadixKey) -> tuple[TreeNode, torch.Tensor]:
        """Match the page-aligned prefix of `key`, lock its last node and count a hit
        on every node of the path. Mutates: may split a node. Returns (node, slots)."""
        result = self.match_prefix(MatchPrefixParams(key=key))
        node = result.last_device_node
        self.inc_lock_ref(node)
        walk = node
        while walk is not self.root_node:
            walk.hit_count += 1
            walk = walk.parent
        return node, self.path_device_indices(node)

    def insert_sequence(self, key: RadixKey, slots: torch.Tensor) -> tuple[TreeNode, int]:
        """Insert the page-aligned part of `key` with its slots.

        Returns (last node, prefix_len), where prefix_len tokens were already in the
        tree: the caller's slots for them are duplicates and must be freed by it.
        """
        aligned = key.page_aligned(self.page_size)
        result = self.insert(
            InsertParams(key=aligned, value=slots[: len(aligned)], inserted_len=len(aligned))
        )
        return result.last_device_node, result.prefix_len

    def evict_tokens(self, num_tokens: int) -> int:
        """Free at least `num_tokens` from unlocked LRU leaves if possible; returns freed."""
        return self.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def probe(self, key: RadixKey) -> ProbeResult:
        """Longest prefix of `key` held in the tree, without mutating anything."""
        node, pos, n, ps = self.root_node, 0, len(key), self.page_size
        while pos < n:
            child = None
            if n - pos >= ps:
                child = node.children.get(key.child_key_at(pos, ps))
            if child is None:
                # The key diverges (or ends) inside the first page of a child:
                # logically reusable, physically not (page granularity).
                best = max((_lcp(c.key, key, pos) for c in self._same_ns(node, key)), default=0)
                return ProbeResult(logical_len=pos + best, device_len=pos)
            m = _lcp(child.key, key, pos)
            if m < len(child.key):
                return ProbeResult(logical_len=pos + m, device_len=pos + m // ps * ps)
            pos += m
            node = child
        return ProbeResult(logical_len=pos, device_len=pos)

    def _same_ns(self, node: TreeNode, key: RadixKey) -> Iterator[TreeNode]:
        for child in node.children.values():
            if child.key.extra_key == key.extra_key and child.key.cache_salt == key.cache_salt:
                yield child

    # ----- inspection -------------------------------------------------------

    def iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def owners_by_node(self) -> dict[int, list[str]]:
        owners: dict[int, list[str]] = {}
        for owner, node in self.chains.items():
            while node is not self.root_node:
                owners.setdefault(node.id, []).append(owner)
                node = node.parent
        return owners

    def snapshot(
        self,
        preview: Callable[[Sequence[int]], str] = lambda ids: " ".join(map(str, ids)),
        owner: Optional[str] = None,
        preview_tokens: int = 16,
        both: frozenset = frozenset(),
    ) -> list[NodeInfo]:
        """Every node (or only `owner`'s chain), parents before children. Nodes
        in `both` also have a host copy. Read-only."""
        owners = self.owners_by_node()
        now = time.monotonic()
        out = []
        for node in sorted(self.iter_nodes(), key=lambda n: (_depth(n), n.id)):
            who = tuple(sorted(owners.get(node.id, ())))
            if owner is not None and owner not in who:
                continue
            parent = node.parent
            out.append(
                NodeInfo(
                    id=node.id,
                    parent=None if parent is self.root_node else parent.id,
                    tokens=len(node.key),
                    depth_tokens=_depth(node),
                    preview=preview(list(node.key.token_ids[:preview_tokens])),
                    hit_count=node.hit_count,
                    lock_count=node.lock_ref,
                    last_access_age_s=round(now - node.last_access_time, 3),
                    residency="evicted" if node.evicted else ("both" if node.id in both else "device"),
                    owners=who,
                    namespace=node.key.extra_key,
                )
            )
        return out

    def check_integrity(self, in_flight_tokens: Optional[int] = 0, in_flight_locks: Optional[int] = 0) -> None:
        """Assert that pool accounting, lock counts and chains add up.

        `in_flight_tokens` are slots owned by running steps (not in the tree, not
        free); `in_flight_locks` the temporary locks those steps hold. None skips
        that part (a scheduler with requests running knows neither exactly).
        """
        alloc = self.token_to_kv_pool_allocator
        ps = self.page_size
        cached = 0
        seen_pages: set[int] = set()
        for node in self.iter_nodes():
            assert len(node.key) % ps == 0, f"node {node.id} key not page aligned"
            assert len(node.value) == len(node.key), f"node {node.id} value/key length"
            assert node.lock_ref >= 0, f"node {node.id} negative lock {node.lock_ref}"
            pages = set((node.value[::ps] // ps).tolist())
            assert not (pages & seen_pages), f"node {node.id} shares pages with another node"
            seen_pages |= pages
            cached += len(node.key)
        free_pages = set(alloc.get_all_free_pages().tolist())
        assert not (free_pages & seen_pages), "a cached page is also on the free list"
        if in_flight_tokens is not None:
            assert alloc.available_size() + cached + in_flight_tokens == self.capacity, (
                f"free {alloc.available_size()} + cached {cached} + in flight "
                f"{in_flight_tokens} != capacity {self.capacity}"
            )
        assert self.evictable_size_ + self.protected_size_ == cached, "size counters drifted"
        # Every lock is a chain tail or an in-flight step: count locks per subtree.
        expected: dict[int, int] = {}
        for owner, node in self.chains.items():
            walk = node
            while walk is not self.root_node:
                parent = walk.parent
                # An evicted node keeps its parent pointer; it is in the tree only
                # if its parent still lists it.
                assert parent is not None and parent.children.get(walk.key.child_key(ps)) is walk, (
                    f"chain of {owner} left the tree at node {walk.id}"
                )
                expected[walk.id] = expected.get(walk.id, 0) + 1
                walk = walk.parent
        nodes = list(self.iter_nodes())
        diff = {n.id: n.lock_ref - expected.get(n.id, 0) for n in nodes}
        stray = 0
        for node in nodes:
            # A lock on X adds one to X and every ancestor: what a node holds
            # beyond its children's surplus is locks taken on it directly.
            own = diff[node.id] - sum(diff[c.id] for c in node.children.values())
            assert own >= 0, f"node {node.id} holds fewer locks than its subtree"
            stray += own
        assert in_flight_locks is None or stray == in_flight_locks, (
            f"{stray} stray locks, expected {in_flight_locks}")
        assert self.root_node.lock_ref == 1, "root lock changed"


def _depth(node: TreeNode) -> int:
    total = 0
    while node.parent is not None:
        total += len(node.key)
        node = node.parent
    return total


def _lcp(stored: RadixKey, key: RadixKey, offset: int) -> int:
    """Token-level common prefix of a stored node key and key[offset:]."""
    return stored.match_at(key, offset=offset, page_size=1)
