"""KVMover against SGLang's own `get_cpu_copy` as the oracle, and the host
tier's arena: ranges, reservations and least-recently-stored drops."""

from __future__ import annotations

from array import array

import torch

from radix_ext.host_tier import HostEntry, HostTier, Ranges
from radix_ext.kv_copy import KVMover
from radix_ext.pools import PoolSpec, build_pools


def filled_pools(dtype=torch.float32):
    pools = build_pools(
        PoolSpec(
            pool_tokens=128, page_size=4, max_running=2, max_context=64,
            num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu",
        )
    )
    gen = torch.Generator().manual_seed(0)
    for buf in (*pools.kv.k_buffer, *pools.kv.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    return pools


def sglang_copy(pools, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's CPU copy (per layer, per chunk, [k, v]) as [layers, tokens, heads, dim]."""
    copy = pools.allocator.get_cpu_copy(slots)
    k = torch.stack([torch.cat([chunk[0] for chunk in layer]) for layer in copy])
    v = torch.stack([torch.cat([chunk[1] for chunk in layer]) for layer in copy])
    return k, v


def test_to_host_equals_sglangs_cpu_copy():
    pools = filled_pools(torch.bfloat16)
    slots = pools.allocator.alloc(12)
    mover = KVMover(pools.kv)
    host = mover.empty(20).narrow(5, 12)  # a range of an arena, as the host tier uses it
    mover.to_host(slots, host)
    k, v = sglang_copy(pools, slots)
    assert torch.equal(host.k, k) and torch.equal(host.v, v)
    assert len(host) == 12 and host.nbytes == 2 * 3 * 12 * 2 * 8 * 2
    assert not host.k.is_pinned()  # pinned only on CUDA


def test_round_trip_into_other_slots_is_bit_identical():
    pools = filled_pools()
    mover = KVMover(pools.kv)
    src, dst = pools.allocator.alloc(8), pools.allocator.alloc(8)
    host = mover.empty(8)
    mover.to_host(src, host)
    mover.to_device(host, dst)
    for k, v in zip(pools.kv.k_buffer, pools.kv.v_buffer):
        assert torch.equal(k[src], k[dst]) and torch.equal(v[src], v[dst])
    # The oracle reads the same bytes back.
    k, v = sglang_copy(pools, dst)
    assert torch.equal(host.k, k) and torch.equal(host.v, v)


def test_ranges_first_fit_and_merge():
    r = Ranges(10)
    assert [r.alloc(3), r.alloc(3), r.alloc(3), r.alloc(3)] == [0, 3, 6, None]
    r.release(3, 3)
    r.release(0, 3)  # merges with [3, 6)
    assert r.free == [[0, 6], [9, 1]] and r.alloc(5) == 0
    r.release(6, 3)
    r.release(0, 5)
    assert r.free == [[0, 10]]


def tier(capacity: int) -> HostTier:
    return HostTier(KVMover(filled_pools().kv).empty(capacity))


def store(host: HostTier, owner: str, n: int) -> HostEntry:
    res = host.reserve(owner, n)
    entry = HostEntry(owner, 0, 1, array("q", range(n)), res.start, res.kv)
    host.commit(entry, res, copy_ms=1.0, copied_tokens=n)
    return entry


def test_reserving_drops_the_least_recently_stored_until_a_range_fits():
    host = tier(10)
    store(host, "a", 4)
    store(host, "b", 3)
    store(host, "c", 3)
    host.take("b")  # frees [4, 7): 3 free, but 5 are asked for
    res = host.reserve("d", 5)
    assert res.start == 0 and list(host.entries) == ["c"]  # a dropped, then [0, 7) fits
    assert set(host.evicted) == {"a"} and host.stats.lost_tokens == 4
    host.check()
    host.cancel(res)
    host.check()
    assert host.used_tokens == 3 and host.reserve("c", 8) is None  # never the owner's own copy
    host.check()


def test_commit_replaces_the_owners_entry_and_frees_its_range():
    host = tier(8)
    store(host, "a", 4)
    second = store(host, "a", 4)
    assert list(host.entries) == ["a"] and host.entries["a"] is second and host.used_tokens == 4
    assert host.stats.demoted_tokens == 8
    host.check()


def test_reserving_drops_nothing_when_dropping_cannot_make_room():
    host = tier(10)
    for owner, n in (("a", 4), ("b", 3), ("c", 3)):
        store(host, owner, n)
    assert host.reserve("c", 8) is None  # a and b free only 7 beside c's own copy
    assert list(host.entries) == ["a", "b", "c"] and host.stats.lost_tokens == 0
    host.check()


def test_a_pinned_entry_is_not_dropped_for_room():
    host = tier(10)
    for owner, n in (("a", 4), ("b", 3), ("c", 3)):
        store(host, owner, n)
    host.pin("a")
    res = host.reserve("d", 3)
    assert res.start == 4 and list(host.entries) == ["a", "c"]  # b went, not the older a
    host.unpin("a")
    host.cancel(res)
    host.check()
