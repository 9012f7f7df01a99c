"""Read-only views of a SessionRadixCache (tree.py): `probe`, the reusable
prefix of a key, logical and page-aligned, without the node splits and access
times that `match_prefix` changes; `snapshot`, every node with
its hits, locks, residency and owners, for debugging; `check_integrity`, that
pool accounting, lock counts and chain membership add up. `tree` is the cache;
nothing here changes it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from radix_ext.children import indexed, namespace_of
from radix_ext.tails import check_tail


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
    namespace: Optional[str]  # the key's extra_key: model, tokenizer and template
    cache_salt: Optional[str] = None  # the key's salt: the tenant

def probe(tree, key: RadixKey) -> ProbeResult:
    """Longest prefix of `key` held in the tree, without mutating anything."""
    node, pos, n, ps = tree.root_node, 0, len(key), tree.page_size
    while pos < n:
        child = None
        if n - pos >= ps:
            child = node.children.get(key.child_key_at(pos, ps))
        if child is None:
            # The key diverges (or ends) inside the first page of a child:
            # logically reusable, physically not (page granularity).
            # The sorted index finds the best child by bisection (children.py).
            page = tuple(key.token_ids[pos: pos + min(ps, n - pos)])
            best = indexed(node).longest_partial(namespace_of(key.extra_key, key.cache_salt), page)
            return ProbeResult(logical_len=pos + best, device_len=pos)
        m = _lcp(child.key, key, pos)
        if m < len(child.key):
            return ProbeResult(logical_len=pos + m, device_len=pos + m // ps * ps)
        pos += m
        node = child
    return ProbeResult(logical_len=pos, device_len=pos)


def snapshot(
    tree,
    preview: Callable[[Sequence[int]], str] = lambda ids: " ".join(map(str, ids)),
    owner: Optional[str] = None,
    preview_tokens: int = 16,
    both: frozenset = frozenset(),
) -> list[NodeInfo]:
    """Every node (or only `owner`'s chain), parents before children. Nodes
    in `both` also have a host copy. Read-only."""
    owners = tree.owners_by_node()
    now = time.monotonic()
    out = []
    for node in sorted(tree.iter_nodes(), key=lambda n: (depth(n), n.id)):
        who = tuple(sorted(owners.get(node.id, ())))
        if owner is not None and owner not in who:
            continue
        parent = node.parent
        out.append(
            NodeInfo(
                id=node.id,
                parent=None if parent is tree.root_node else parent.id,
                tokens=len(node.key),
                depth_tokens=depth(node),
                preview=preview(list(node.key.token_ids[:preview_tokens])),
                hit_count=node.hit_count,
                lock_count=node.lock_ref,
                last_access_age_s=round(now - node.last_access_time, 3),
                residency="evicted" if node.evicted else ("both" if node.id in both else "device"),
                owners=who,
                namespace=node.key.extra_key,
                cache_salt=node.key.cache_salt,
            )
        )
    return out


def check_integrity(tree, in_flight_tokens: Optional[int] = 0, in_flight_locks: Optional[int] = 0) -> None:
    """Assert that pool accounting, lock counts and chains add up.

    `in_flight_tokens` are slots owned by running steps (not in the tree, not
    free); `in_flight_locks` the temporary locks those steps hold. None skips
    that part (a scheduler with requests running knows neither exactly).
    """
    alloc = tree.token_to_kv_pool_allocator
    ps = tree.page_size
    cached = 0
    seen_pages: set[int] = set()
    for node in tree.iter_nodes():
        assert len(node.key) % ps == 0, f"node {node.id} key not page aligned"
        assert len(node.value) == len(node.key), f"node {node.id} value/key length"
        assert node.lock_ref >= 0, f"node {node.id} negative lock {node.lock_ref}"
        pages = set((node.value[::ps] // ps).tolist())
        assert not (pages & seen_pages), f"node {node.id} shares pages with another node"
        seen_pages |= pages
        cached += len(node.key)
    free_pages = set(alloc.get_all_free_pages().tolist())
    assert not (free_pages & seen_pages), "a cached page is also on the free list"
    for owner, tail in tree.tails.items():
        check_tail(owner, tail, ps)
        assert owner in tree.chains, f"private page of {owner} without a chain"
        page = int(tail.page[0]) // ps
        assert page not in seen_pages and page not in free_pages, f"private page of {owner} is shared"
        seen_pages.add(page)
    if in_flight_tokens is not None:
        private = tree.private_tokens()
        assert alloc.available_size() + cached + private + in_flight_tokens == tree.capacity, (
            f"free {alloc.available_size()} + cached {cached} + private {private} + in flight "
            f"{in_flight_tokens} != capacity {tree.capacity}"
        )
    assert tree.evictable_size_ + tree.protected_size_ == cached, "size counters drifted"
    # Every lock is a chain tail or an in-flight step: count locks per subtree.
    expected: dict[int, int] = {}
    for owner, node in tree.chains.items():
        walk = node
        while walk is not tree.root_node:
            parent = walk.parent
            # An evicted node keeps its parent pointer; it is in the tree only
            # if its parent still lists it.
            assert parent is not None and parent.children.get(walk.key.child_key(ps)) is walk, (
                f"chain of {owner} left the tree at node {walk.id}"
            )
            expected[walk.id] = expected.get(walk.id, 0) + 1
            walk = walk.parent
    nodes = list(tree.iter_nodes())
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
    assert tree.root_node.lock_ref == 1, "root lock changed"



def depth(node: TreeNode) -> int:
    """Tokens from the root to the end of `node`."""
    total = 0
    while node.parent is not None:
        total += len(node.key)
        node = node.parent
    return total


def _lcp(stored: RadixKey, key: RadixKey, offset: int) -> int:
    """Token-level common prefix of a stored node key and key[offset:]."""
    return stored.match_at(key, offset=offset, page_size=1)
