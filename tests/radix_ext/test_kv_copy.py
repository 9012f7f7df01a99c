"""KVMover against SGLang's own `get_cpu_copy` / `load_cpu_copy` as the oracle."""

from __future__ import annotations

import torch

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
    host = KVMover(pools.kv).to_host(slots)
    k, v = sglang_copy(pools, slots)
    assert torch.equal(host.k, k) and torch.equal(host.v, v)
    assert len(host) == 12 and host.nbytes == 2 * 3 * 12 * 2 * 8 * 2
    assert not host.k.is_pinned()  # pinned only on CUDA


def test_round_trip_into_other_slots_is_bit_identical():
    pools = filled_pools()
    mover = KVMover(pools.kv)
    src, dst = pools.allocator.alloc(8), pools.allocator.alloc(8)
    host = mover.to_host(src)
    mover.to_device(host, dst)
    for k, v in zip(pools.kv.k_buffer, pools.kv.v_buffer):
        assert torch.equal(k[src], k[dst]) and torch.equal(v[src], v[dst])
    # The oracle reads the same bytes back.
    k, v = sglang_copy(pools, dst)
    assert torch.equal(host.k, k) and torch.equal(host.v, v)


def test_join_is_the_copy_of_both_ranges():
    pools = filled_pools()
    mover = KVMover(pools.kv)
    slots = pools.allocator.alloc(12)
    joined = mover.join(mover.to_host(slots[:4]), mover.to_host(slots[4:]))
    whole = mover.to_host(slots)
    assert torch.equal(joined.k, whole.k) and torch.equal(joined.v, whole.v)
