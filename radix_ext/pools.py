"""SGLang's request and KV pools, built for one model shape on CPU or one GPU.

This module and `tree.py` are the only places that construct SGLang pool
types; a version bump of sglang lands here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolSpec:
    """Sizes of the pools: tokens of KV, rows of requests, and the KV shape."""

    pool_tokens: int
    page_size: int
    max_running: int
    max_context: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class KVPools:
    """The three SGLang pools one engine owns."""

    spec: PoolSpec
    req_to_token: object  # sglang ReqToTokenPool
    allocator: object  # sglang PagedTokenToKVPoolAllocator
    kv: object  # sglang MHATokenToKVPool

    @property
    def capacity(self) -> int:
        """Usable token slots (SGLang reserves page 0 for padding)."""
        return self.allocator.num_pages * self.spec.page_size


def build_pools(spec: PoolSpec) -> KVPools:
    """Allocate the pools. Raises ValueError when the sizes are not page-aligned."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    if spec.pool_tokens % spec.page_size:
        raise ValueError(
            f"pool_tokens ({spec.pool_tokens}) must be a multiple of page_size ({spec.page_size})"
        )
    kv = MHATokenToKVPool(
        spec.pool_tokens, spec.page_size, spec.dtype, spec.num_kv_heads, spec.head_dim,
        spec.num_layers, spec.device, False, enable_alt_stream=False,
    )
    allocator = PagedTokenToKVPoolAllocator(
        spec.pool_tokens, spec.page_size, spec.dtype, spec.device, kv, False
    )
    req_to_token = ReqToTokenPool(spec.max_running, spec.max_context, spec.device, False)
    return KVPools(spec=spec, req_to_token=req_to_token, allocator=allocator, kv=kv)
