"""GPU checks of KVMover: pinned host buffers, SGLang's copy as the oracle, a
bit-identical round trip. (The overlap with compute is measured in bench/offload.py.)
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from radix_ext.kv_copy import KVMover
from radix_ext.pools import PoolSpec, build_pools

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_pools(tokens=65536):
    # The qwen3-0.6b KV shape: 28 layers, 8 KV heads of 128, bf16 (112 KiB a token).
    pools = build_pools(PoolSpec(pool_tokens=tokens, page_size=16, max_running=4, max_context=tokens,
                                 num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"))
    for buf in (*pools.kv.k_buffer, *pools.kv.v_buffer):
        buf.normal_()
    return pools


def test_pinned_copy_matches_sglang_and_round_trips():
    pools = cuda_pools(8192)
    mover = KVMover(pools.kv)
    src, dst = pools.allocator.alloc(4096), pools.allocator.alloc(4096)
    host = mover.empty(4096)
    mover.to_host(src, host)
    assert host.k.is_pinned() and host.v.is_pinned()
    oracle = pools.allocator.get_cpu_copy(src)
    for layer in range(28):
        assert torch.equal(host.k[layer], torch.cat([c[0] for c in oracle[layer]]))
        assert torch.equal(host.v[layer], torch.cat([c[1] for c in oracle[layer]]))
    mover.to_device(host, dst)
    for k, v in zip(pools.kv.k_buffer, pools.kv.v_buffer):
        assert torch.equal(k[src], k[dst]) and torch.equal(v[src], v[dst])

