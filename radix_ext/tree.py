"""SessionRadixCache: SGLang's RadixCache plus per-conversation chains.

What it adds to the parent class:
- chains: each conversation's tail node is locked, so its path is never
  evicted; `set_chain` moves the lock, `release_chain` drops it;
- private tails: a chain's partial last page, held by it alone (`tails.py`);
- `hold_prefix`: the fork after a turn drops its reasoning, with the partial
  page copied and the generated branch past it freed at once;
- `probe`: the reusable prefix of a key, logical and page-aligned, without the
  node splits and access-time updates that `match_prefix` makes;
- `snapshot`: every node with hits, locks, residency and owners, for debugging;
- `check_integrity`: pool accounting, lock counts and chain membership
  (both read-only views, in tree_views.py).
"""

from __future__ import annotations

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

from radix_ext import tree_views
from radix_ext.pools import KVPools
from radix_ext.tails import PrivateTail, common_length, copy_slots, page_of
from radix_ext.tree_views import NodeInfo, ProbeResult, depth as _depth


@dataclass(frozen=True)
class Namespace:
    """What separates cache entries: model+tokenizer+template, and the tenant."""

    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None

    def key(self, token_ids: Sequence[int]) -> RadixKey:
        ids = token_ids if isinstance(token_ids, array) else array("q", token_ids)
        return RadixKey(ids, extra_key=self.extra_key, cache_salt=self.cache_salt)


@dataclass(frozen=True)
class TailPlan:
    """A chain's exclusive tail, chosen for demotion: `nodes` (top-down) are held
    by this chain alone and hang from `anchor`."""

    owner: str
    tail: TreeNode
    anchor: TreeNode
    nodes: tuple[TreeNode, ...]
    slots: torch.Tensor  # the nodes' slots, then the private tail's
    tokens: array
    private: Optional[PrivateTail] = None


class SessionRadixCache(RadixCache):
    """A RadixCache whose conversations each hold a locked chain."""

    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        self.chains: dict[str, TreeNode] = {}
        self.tails: dict[str, PrivateTail] = {}  # owner -> its chain's partial last page

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

    def set_chain(self, owner: str, node: TreeNode, tail: Optional[PrivateTail] = None) -> None:
        """Lock `node` for `owner` and unlock the owner's previous tail; `tail`
        (pages the caller owns) becomes the chain's private partial page, and a
        previous private page not handed back is freed.

        Locks the new tail before unlocking the old one, so a shared prefix is
        never evictable in between.
        """
        self.inc_lock_ref(node)
        old = self.chains.get(owner)
        if old is not None:
            self.dec_lock_ref(old)
        self.chains[owner] = node
        self._set_tail(owner, tail)

    def release_chain(self, owner: str) -> None:
        """Unlock the owner's chain; its nodes become evictable (LRU) and its
        private page is freed. No-op if none."""
        old = self.chains.pop(owner, None)
        if old is not None:
            self.dec_lock_ref(old)
        self._set_tail(owner, None)

    def _set_tail(self, owner: str, tail: Optional[PrivateTail]) -> None:
        old = self.tails.pop(owner, None)
        if old is not None and (tail is None or old.page[0] != tail.page[0]):
            self.token_to_kv_pool_allocator.free(old.page)
        if tail is not None and len(tail.tokens):
            self.tails[owner] = tail
        elif tail is not None:
            self.token_to_kv_pool_allocator.free(tail.page)

    def take_tail(self, owner: str, node: TreeNode, key: RadixKey, limit: int) -> Optional[PrivateTail]:
        """The owner's private page, handed to a step whose matched prefix ends at
        the chain's node: its head that `key[depth:limit]` continues. The step
        owns the page now (it writes the rest of it) and gives it back with
        `set_chain` or `return_tail`. None (and the page stays) otherwise."""
        tail = self.tails.get(owner)
        if tail is None or self.chains.get(owner) is not node:
            return None
        k = common_length(tail.tokens, key.token_ids, _depth(node), limit)
        if k == 0:
            return None
        del self.tails[owner]
        return tail.head(k)

    def return_tail(self, owner: str, node: TreeNode, tail: PrivateTail) -> None:
        """A step that took `tail` failed: its head is intact (the step wrote only
        past it). Back to the chain if the chain is still at `node`, else freed."""
        if self.chains.get(owner) is node and owner not in self.tails:
            self.tails[owner] = tail
        else:
            self.token_to_kv_pool_allocator.free(tail.page)

    def make_tail(self, tokens: Sequence[int], page: torch.Tensor) -> Optional[PrivateTail]:
        """A private tail of `tokens` in the head of `page` (None for no tokens)."""
        return PrivateTail(array("q", tokens), page) if len(tokens) else None

    def hold_prefix(self, owner: str, key: RadixKey, free_branch: bool = False) -> int:
        """Move `owner`'s chain to the fork point `key` (the canonical prefix a
        closed turn shares with what it generated). The cached page-aligned
        prefix is held; the valid head of the page the fork falls in is copied
        from the old chain into a fresh private page (exact: same positions,
        same prefix). With `free_branch`, the old chain's nodes past the fork
        that no other chain or request holds are freed at once. Mutates: may
        split a node. Returns the chain's new length in tokens."""
        old, old_tail = self.chains.get(owner), self.tails.get(owner)
        node = self.match_prefix(MatchPrefixParams(key=key)).last_device_node
        tail = self._copy_fork_page(old, old_tail, node, key)
        self.set_chain(owner, node, tail)
        if free_branch and old is not None:
            self.free_branch(old)
        return self.chain_tokens(owner)

    def _copy_fork_page(self, old, old_tail, node: TreeNode, key: RadixKey) -> Optional[PrivateTail]:
        """A fresh page holding key[depth(node):] (less than a page) copied from
        the old chain's path, or None when it has no such head or the pool has
        no page even after evicting."""
        a, ps = _depth(node), self.page_size
        want = min(len(key), a + ps - 1) - a
        if old is None or want <= 0:
            return None
        path = self.path_tokens(old)
        slots = self.path_device_indices(old)
        if old_tail is not None:
            path.extend(old_tail.tokens)
            slots = torch.cat((slots, old_tail.slots))
        if old.key.extra_key != key.extra_key or old.key.cache_salt != key.cache_salt:
            return None
        c = common_length(path[a:], key.token_ids, a, a + want) if len(path) > a else 0
        if c == 0 or path[:a] != key.token_ids[:a]:
            return None
        page = self._alloc_page()
        if page is None:
            return None
        try:
            copy_slots(self.token_to_kv_pool_allocator.get_kvcache(), slots[a : a + c], page[:c])
        except BaseException:  # a copy that fails frees what it allocated
            self.token_to_kv_pool_allocator.free(page)
            raise
        return PrivateTail(array("q", key.token_ids[a : a + c]), page)

    def _alloc_page(self) -> Optional[torch.Tensor]:
        slots = self.alloc_pages(self.page_size)
        return None if slots is None else page_of(slots, self.page_size)

    def alloc_pages(self, tokens: int) -> Optional[torch.Tensor]:
        """Whole pages for `tokens` slots, evicting unlocked LRU leaves if short;
        None (nothing taken) when even that is not enough."""
        alloc, ps = self.token_to_kv_pool_allocator, self.page_size
        need = -(-tokens // ps) * ps
        if alloc.available_size() < need <= alloc.available_size() + self.evictable_size():
            self.evict(EvictParams(num_tokens=need - alloc.available_size()))
        return alloc.alloc(need) if alloc.available_size() >= need else None

    def free_branch(self, node: TreeNode) -> int:
        """Free `node` and its ancestors, leaf upwards, while they are unlocked
        leaves (no chain, no request in flight, no other branch below). Returns
        the tokens freed."""
        freed = 0
        while node is not self.root_node and node.lock_ref == 0 and not node.children and not node.evicted:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(self.page_size)) is not node:
                break  # already gone from the tree
            self.token_to_kv_pool_allocator.free(node.value)
            self._delete_leaf(node)
            self.kv_events.record_remove(node)
            freed += len(node.key)
            node = parent
        return freed

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
        """Tokens the owner's chain holds: its node's depth plus its private page's."""
        node = self.chains.get(owner)
        tail = self.tails.get(owner)
        return (0 if node is None else _depth(node)) + (0 if tail is None else len(tail.tokens))

    def chain_slots(self, owner: str) -> torch.Tensor:
        node = self.chains.get(owner)
        if node is None:
            return self._empty_device_indices
        tail = self.tails.get(owner)
        slots = self.path_device_indices(node)
        return slots if tail is None else torch.cat((slots, tail.slots))

    def private_tokens(self) -> int:
        """Slots held by private pages (whole pages)."""
        return len(self.tails) * self.page_size

    # ----- host tier -------------------------------------------------------------

    def plan_demote(self, owner: str) -> Optional[TailPlan]:
        """The owner's exclusive tail: nodes locked by its chain only, with no
        other branch below them. None when there is nothing to demote. Read-only."""
        node = self.chains.get(owner)
        private = self.tails.get(owner)
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
        values = [n.value for n in nodes]
        if private is not None:
            tokens.extend(private.tokens)
            values.append(private.slots)
        return TailPlan(owner, node, walk, tuple(nodes), torch.cat(values), tokens, private)

    def plan_still_valid(self, plan: TailPlan) -> bool:
        """Has nothing touched the planned tail since `plan_demote`?"""
        if self.chains.get(plan.owner) is not plan.tail or plan.nodes[0].parent is not plan.anchor:
            return False
        if self.tails.get(plan.owner) is not plan.private:
            return False
        last = len(plan.nodes) - 1
        for i, n in enumerate(plan.nodes):
            attached = n.parent is not None and n.parent.children.get(n.key.child_key(self.page_size)) is n
            # A split inside the tail puts a new node between two planned ones.
            linked = i == 0 or n.parent is plan.nodes[i - 1]
            if not attached or not linked or n.lock_ref != 1 or len(n.children) != (0 if i == last else 1):
                return False
        private = 0 if plan.private is None else len(plan.private.tokens)
        return sum(len(n.key) for n in plan.nodes) + private == len(plan.tokens)

    def drop_tail(self, plan: TailPlan) -> None:
        """Move the chain to the anchor and delete the tail, freeing its device
        pages and private page (their KV now lives on the host). Requires
        plan_still_valid(plan)."""
        self.set_chain(plan.owner, plan.anchor)
        for node in reversed(plan.nodes):
            assert not node.children, f"node {node.id} of a demoted tail is not a leaf"
            self.token_to_kv_pool_allocator.free(node.value)
            self._delete_leaf(node)
            self.kv_events.record_remove(node)

    def restore_tail(self, owner: str, key: RadixKey, slots: torch.Tensor) -> int:
        """Insert `key` (the chain's anchor path plus a reloaded tail in `slots`,
        whole pages) and move the chain to its end; a partial last page becomes
        the chain's private page. Returns the insert's prefix_len: reloaded
        slots below it duplicate KV already in the tree, the caller frees them."""
        anchor = self.chains[owner]
        start = _depth(anchor)
        value = torch.cat((self.path_device_indices(anchor), slots))
        node, prefix_len = self.insert_sequence(key, value)
        aligned = len(key) // self.page_size * self.page_size
        page = slots[aligned - start : aligned - start + self.page_size]
        self.set_chain(owner, node, self.make_tail(key.token_ids[aligned:], page) if len(page) else None)
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
        """Longest prefix of `key` held in the tree, without mutating anything (tree_views.py)."""
        return tree_views.probe(self, key)

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
        in `both` also have a host copy. Read-only (tree_views.py)."""
        return tree_views.snapshot(self, preview, owner, preview_tokens, both)

    def check_integrity(self, in_flight_tokens: Optional[int] = 0, in_flight_locks: Optional[int] = 0) -> None:
        """Assert that pool accounting, lock counts and chains add up (tree_views.py)."""
        tree_views.check_integrity(self, in_flight_tokens, in_flight_locks)
