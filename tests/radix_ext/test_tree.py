"""SessionRadixCache over tiny SGLang pools, driven with integer token sequences."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from sglang.srt.mem_cache import radix_cache as sgl_radix
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from radix_ext.pools import PoolSpec, build_pools
from radix_ext.tree import Namespace, ProbeResult, SessionRadixCache

NS = Namespace(extra_key="m")


def make_tree(page_size: int = 4, pool_tokens: int = 64) -> SessionRadixCache:
    pools = build_pools(
        PoolSpec(
            pool_tokens=pool_tokens, page_size=page_size, max_running=2, max_context=64,
            num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu",
        )
    )
    return SessionRadixCache.over_pools(pools)


def put(tree: SessionRadixCache, tokens, ns: Namespace = NS, owner=None):
    """Insert `tokens` as the engine does: fresh page-aligned slots, duplicates
    and the partial tail page freed; optionally make it `owner`'s chain."""
    ps = tree.page_size
    alloc = tree.token_to_kv_pool_allocator
    slots = alloc.alloc(-(-len(tokens) // ps) * ps)
    assert slots is not None, "test pool too small"
    aligned = len(tokens) // ps * ps
    node, prefix_len = tree.insert_sequence(ns.key(tokens), slots[:aligned])
    alloc.free(slots[:prefix_len])
    alloc.free(slots[aligned:])
    if owner is not None:
        tree.set_chain(owner, node)
    return node, prefix_len


def used(tree) -> int:
    return tree.capacity - tree.token_to_kv_pool_allocator.available_size()


def shape(tree):
    """Everything a read-only call must not change."""
    return sorted(
        (n.id, n.parent.id, tuple(n.key.token_ids), n.lock_ref, n.hit_count, n.last_access_time, tuple(n.value.tolist()))
        for n in tree.iter_nodes()
    )


@pytest.fixture
def fake_clock(monkeypatch):
    """Make the tree's access times a strictly increasing counter, so LRU order is exact."""
    counter = itertools.count(1000.0)
    fake = types.SimpleNamespace(monotonic=lambda: next(counter), perf_counter=sgl_radix.time.perf_counter, time=sgl_radix.time.time)
    monkeypatch.setattr(sgl_radix, "time", fake)


A = list(range(1, 13))  # 12 tokens: 3 pages of 4


# ----- probe ----------------------------------------------------------------


@pytest.mark.parametrize(
    "key, logical, device",
    [
        (A, 12, 12),
        (A + [77, 78, 79], 12, 12),
        (A[:10], 10, 8),  # ends inside a page
        (A[:6] + [99] * 6, 6, 4),  # diverges inside the second page
        ([1, 2, 3, 99, 5, 6], 3, 0),  # diverges inside the first page
        ([1, 2], 2, 0),  # shorter than a page
        ([50, 51, 52, 53], 0, 0),
        ([], 0, 0),
    ],
)
def test_probe_lengths(key, logical, device):
    tree = make_tree()
    put(tree, A)
    before = shape(tree)
    r = tree.probe(NS.key(key))
    assert (r.logical_len, r.device_len) == (logical, device)
    assert shape(tree) == before
    tree.check_integrity()


def test_probe_through_a_branch():
    tree = make_tree()
    put(tree, A)
    put(tree, A[:8] + [50, 51, 52, 53])  # splits A after 8 tokens
    assert sorted(len(n.key) for n in tree.iter_nodes()) == [4, 4, 8]
    before = shape(tree)
    assert tree.probe(NS.key(A[:8] + [50, 51, 60, 61])) == ProbeResult(10, 8)
    assert tree.probe(NS.key(A[:8] + [50, 51, 52, 53, 54])).logical_len == 12
    # Last partial page: best common prefix over the branch's children.
    r = tree.probe(NS.key(A[:8] + [9, 10]))
    assert (r.logical_len, r.device_len) == (10, 8)
    assert shape(tree) == before
    tree.check_integrity()


def test_probe_does_not_split_where_match_prefix_does():
    tree = make_tree()
    put(tree, A)
    key = NS.key(A[:6] + [99] * 6)
    ids = [n.id for n in tree.iter_nodes()]
    before = shape(tree)
    r = tree.probe(key)
    assert (r.logical_len, r.device_len) == (6, 4)
    assert [n.id for n in tree.iter_nodes()] == ids and shape(tree) == before

    res = tree.match_prefix(MatchPrefixParams(key=key))
    assert res.device_prefix_len == 4  # same as the probe's device_len
    assert len(list(tree.iter_nodes())) == 2  # match_prefix split the 12-token node
    assert sorted(len(n.key) for n in tree.iter_nodes()) == [4, 8]
    tree.check_integrity()


def test_probe_agrees_with_match_prefix_on_page_size_1():
    tree = make_tree(page_size=1, pool_tokens=32)
    put(tree, A)
    for key, expect in [(A[:5] + [0], 5), (A, 12), ([2], 0), (A + [13], 12)]:
        r = tree.probe(NS.key(key))
        assert r.logical_len == r.device_len == expect
    assert len(list(tree.iter_nodes())) == 1
    assert tree.match_prefix(MatchPrefixParams(key=NS.key(A[:5] + [0]))).device_prefix_len == 5
    assert len(list(tree.iter_nodes())) == 2
    tree.check_integrity()


def _probe_by_scan(tree, key):
    """The probe as it was: every child of the node where the key leaves the tree scanned."""
    node, pos, n, ps = tree.root_node, 0, len(key), tree.page_size
    while pos < n:
        child = node.children.get(key.child_key_at(pos, ps)) if n - pos >= ps else None
        if child is None:
            best = max((c.key.match_at(key, offset=pos, page_size=1) for c in node.children.values()
                        if (c.key.extra_key, c.key.cache_salt) == (key.extra_key, key.cache_salt)), default=0)
            return ProbeResult(pos + best, pos)
        m = child.key.match_at(key, offset=pos, page_size=1)
        if m < len(child.key):
            return ProbeResult(pos + m, pos + m // ps * ps)
        pos, node = pos + m, child
    return ProbeResult(pos, pos)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_probe_by_the_sorted_children_equals_a_scan_of_them(page_size):
    """The probe bisects each node's sorted first pages (radix_ext/children.py);
    under random inserts, splits and evictions in three namespaces it answers
    what scanning every child answers."""
    import random

    rng = random.Random(page_size)
    tree = make_tree(page_size=page_size, pool_tokens=512)
    spaces = [Namespace(), NS, Namespace(extra_key="m", cache_salt="s")]
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(60)]
    for i, seq in enumerate(seqs):
        ns = spaces[i % 3]
        if tree.token_to_kv_pool_allocator.available_size() < 32:
            tree.evict_tokens(64)
        put(tree, seq, ns)
        if i % 5 == 0:  # match_prefix splits nodes where a key leaves them
            tree.match_prefix(MatchPrefixParams(key=ns.key(rng.choice(seqs)[:rng.randrange(1, 10)])))
        for _ in range(12):
            q = spaces[rng.randrange(3)].key([rng.randrange(3) for _ in range(rng.randrange(0, 16))])
            assert tree.probe(q) == _probe_by_scan(tree, q)
    tree.check_integrity()


# ----- namespaces -------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [Namespace(extra_key="x"), Namespace(extra_key="m", cache_salt="tenant"), Namespace(), Namespace(cache_salt="m")],
)
def test_namespaces_never_share(other):
    tree = make_tree()
    put(tree, A)
    for key in (A, A[:10], A[:3]):
        r = tree.probe(other.key(key))
        assert (r.logical_len, r.device_len) == (0, 0)
    assert tree.match_prefix(MatchPrefixParams(key=other.key(A))).device_prefix_len == 0
    _, prefix_len = put(tree, A, ns=other)
    assert prefix_len == 0
    assert used(tree) == 24  # two disjoint copies
    assert len(tree.root_node.children) == 2
    # Each namespace still hits its own copy.
    assert tree.probe(NS.key(A)).device_len == 12
    assert tree.probe(other.key(A)).device_len == 12
    tree.check_integrity()


def test_same_salt_shares_and_empty_salt_is_none():
    tree = make_tree()
    put(tree, A, ns=Namespace(extra_key="m", cache_salt="t1"))
    assert tree.probe(Namespace(extra_key="m", cache_salt="t1").key(A)).device_len == 12
    assert tree.probe(Namespace(extra_key="m", cache_salt="t2").key(A)).device_len == 0
    # RadixKey normalises an empty salt to None.
    put(tree, A, ns=Namespace(extra_key="m", cache_salt=""))
    assert tree.probe(NS.key(A)).device_len == 12
    assert used(tree) == 24
    tree.check_integrity()


# ----- chains and snapshots ---------------------------------------------------


def test_chains_move_and_release_locks():
    tree = make_tree()
    a_node, _ = put(tree, A, owner="c1")
    assert tree.chain_tokens("c1") == 12
    assert (tree.protected_size(), tree.evictable_size()) == (12, 0)

    # c1's next step extends A; c2 branches off A after 8 tokens.
    b = A + [13, 14, 15, 16]
    b_node, prefix = put(tree, b, owner="c1")
    assert prefix == 12
    assert tree.chains["c1"] is b_node
    assert a_node.lock_ref == 1  # only through b_node: c1's old lock moved
    c = A[:8] + [40, 41, 42, 43, 44]  # 13 tokens: 12 cached
    c_node, prefix = put(tree, c, owner="c2")
    assert prefix == 8
    tree.check_integrity()

    snap = {tuple(map(int, s.preview.split()))[:1] + (s.depth_tokens,): s for s in tree.snapshot()}
    # Nodes: [1..8] shared, [9..12], [13..16], [40..43].
    shared, a_rest, b_tail, c_tail = snap[(1, 8)], snap[(9, 12)], snap[(13, 16)], snap[(40, 12)]
    assert (shared.tokens, shared.lock_count, shared.owners, shared.parent) == (8, 2, ("c1", "c2"), None)
    assert (a_rest.tokens, a_rest.lock_count, a_rest.owners, a_rest.parent) == (4, 1, ("c1",), shared.id)
    assert (b_tail.tokens, b_tail.lock_count, b_tail.owners, b_tail.parent) == (4, 1, ("c1",), a_rest.id)
    assert (c_tail.tokens, c_tail.lock_count, c_tail.owners, c_tail.parent) == (4, 1, ("c2",), shared.id)
    assert shared.preview == "1 2 3 4 5 6 7 8" and c_tail.preview == "40 41 42 43"
    assert all(s.residency == "device" and s.namespace == "m" and s.hit_count == 0 for s in snap.values())
    assert [s.id for s in tree.snapshot(owner="c2")] == [shared.id, c_tail.id]
    assert (tree.protected_size(), tree.evictable_size()) == (20, 0)

    tree.release_chain("c1")
    tree.release_chain("c1")  # no-op
    assert "c1" not in tree.chains and tree.chain_tokens("c1") == 0
    locks = {s.id: (s.lock_count, s.owners) for s in tree.snapshot()}
    assert locks == {shared.id: (1, ("c2",)), a_rest.id: (0, ()), b_tail.id: (0, ()), c_tail.id: (1, ("c2",))}
    assert (tree.protected_size(), tree.evictable_size()) == (12, 8)
    tree.check_integrity()

    # Unlocked nodes are evictable; locked ones are not, whatever is asked.
    assert tree.evict_tokens(1000) == 8
    assert tree.probe(NS.key(b)).device_len == 8 and tree.probe(NS.key(c)).device_len == 12
    assert used(tree) == 12
    tree.release_chain("c2")
    assert tree.evict_tokens(1000) == 12 and used(tree) == 0
    assert list(tree.iter_nodes()) == []
    tree.check_integrity()


def test_match_and_lock_counts_hits_and_holds_a_lock():
    tree = make_tree()
    put(tree, A)
    node, slots = tree.match_and_lock(NS.key(A[:10]))  # aligned to 8: splits [1..12]
    assert len(slots) == 8
    snap = tree.snapshot()
    assert [(s.tokens, s.hit_count, s.lock_count) for s in snap] == [(8, 1, 1), (4, 0, 0)]
    assert node.id == snap[0].id
    # The step's lock is "in flight": integrity sees one stray lock.
    tree.check_integrity(in_flight_locks=1)
    with pytest.raises(AssertionError, match="stray locks"):
        tree.check_integrity()
    tree.dec_lock_ref(node)
    tree.match_and_lock(NS.key(A))
    snap = tree.snapshot()
    assert [(s.tokens, s.hit_count, s.lock_count) for s in snap] == [(8, 2, 1), (4, 1, 1)]
    tree.check_integrity(in_flight_locks=1)


def test_set_chain_on_the_same_node_keeps_one_lock():
    tree = make_tree()
    node, _ = put(tree, A, owner="c")
    tree.set_chain("c", node)
    assert node.lock_ref == 1
    tree.check_integrity()


# ----- eviction order -----------------------------------------------------------


def test_evict_unlocked_lru_leaves_in_exact_order(fake_clock):
    tree = make_tree(pool_tokens=64)
    x = [100 + i for i in range(8)]
    y = [200 + i for i in range(8)]
    z = [300 + i for i in range(4)]
    w = [400 + i for i in range(8)]
    put(tree, x)
    put(tree, y, owner="locked")
    put(tree, z)
    put(tree, w)
    # A shared parent with two leaves: [500..503] -> {[504..507], [600..603]}.
    p1 = [500, 501, 502, 503, 504, 505, 506, 507]
    p2 = [500, 501, 502, 503, 600, 601, 602, 603]
    put(tree, p1)
    put(tree, p2)
    # Touch x: it becomes the most recently used.
    tree.match_prefix(MatchPrefixParams(key=NS.key(x)))
    assert used(tree) == 8 + 8 + 4 + 8 + 12
    tree.check_integrity()

    def present():
        return {s.preview.split()[0] for s in tree.snapshot()}

    assert present() == {"100", "200", "300", "400", "500", "504", "600"}
    order = []
    while True:
        before = present()
        freed = tree.evict_tokens(1)
        if freed == 0:
            break
        gone = before - present()
        order.append((sorted(gone), freed))
        tree.check_integrity()
    # LRU: z, w, then p1's leaf (older than p2's), p2's leaf, which leaves the
    # shared parent a leaf, then it; x last; y is locked and stays.
    assert order == [(["300"], 4), (["400"], 8), (["504"], 4), (["600"], 4), (["500"], 4), (["100"], 8)]
    assert present() == {"200"}
    assert used(tree) == 8
    tree.check_integrity()


def test_evict_frees_at_least_what_is_asked(fake_clock):
    tree = make_tree()
    put(tree, [1] * 8)
    put(tree, [2] * 8)
    put(tree, [3] * 8)
    assert tree.evict_tokens(9) == 16  # whole leaves: the two oldest
    assert tree.probe(NS.key([3] * 8)).device_len == 8
    assert tree.probe(NS.key([1] * 8)).device_len == 0
    assert tree.evict_tokens(0) == 0
    tree.check_integrity()


# ----- integrity catches corruption ----------------------------------------------


def test_check_integrity_catches_a_corrupted_lock_count():
    tree = make_tree()
    node, _ = put(tree, A, owner="c")
    put(tree, A[:4] + [9, 9, 9, 9])
    tree.check_integrity()
    node.lock_ref += 1
    with pytest.raises(AssertionError):
        tree.check_integrity()
    node.lock_ref -= 2
    with pytest.raises(AssertionError):
        tree.check_integrity()
    node.lock_ref += 1
    tree.check_integrity()


def test_check_integrity_catches_a_leaked_or_double_owned_page():
    tree = make_tree()
    node, _ = put(tree, A, owner="c")
    leaked = tree.token_to_kv_pool_allocator.alloc(4)
    with pytest.raises(AssertionError, match="capacity"):
        tree.check_integrity()
    tree.check_integrity(in_flight_tokens=4)
    tree.token_to_kv_pool_allocator.free(leaked)
    tree.check_integrity()
    tree.token_to_kv_pool_allocator.free(node.value[:4])  # a cached page put back on the free list
    with pytest.raises(AssertionError, match="free list"):
        tree.check_integrity()


def test_check_integrity_catches_a_chain_whose_node_was_evicted():
    tree = make_tree()
    node, _ = put(tree, A, owner="c")
    tree.dec_lock_ref(node)  # a stray unlock: the chain lost its lock
    assert tree.evict_tokens(100) == 12  # ... so its KV was evicted
    assert tree.chains["c"] is node and list(tree.iter_nodes()) == []
    with pytest.raises(AssertionError):
        tree.check_integrity()
