"""Every KV layout of SGLang's pools, in one place: where a token slot's KV
sits in a pool's buffers, so that a slot range, a page and a host copy move
the pool's own bytes whatever the model and the layout.

- `mha-nhd`: MHATokenToKVPool, token-major (the default): per layer a K and a
  V buffer of [slots, kv_heads, head_dim] (V's head_dim may differ from K's).
- `mha-hnd`: MHATokenToKVPool with SGLANG_USE_HND_KVCACHE: per layer
  [pages, kv_heads, page_size, head_dim]; slot s is page s // page_size,
  offset s % page_size.
- `mla`: MLATokenToKVPool (DeepSeek's multi-head latent attention): per layer
  one latent buffer of [slots, 1, kv_lora_rank + qk_rope_head_dim].

FP8 KV (`--kv-cache-dtype fp8_e4m3`) is any of these with a one-byte store
dtype: the bytes are copied as they are. Every other pool (FP4 and MXFP8
with scale buffers, page-major, vectorized 5-D, DSA's indexer, hybrid and
sparse pools) is refused by `layout_of` with a message that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class UnsupportedLayout(ValueError):
    """A pool whose layout the session tree cannot copy."""


@dataclass(frozen=True)
class Plane:
    """One kind of buffer over every layer: K, V, or MLA's latent."""

    name: str
    buffers: tuple  # per layer
    page_size: int = 0  # > 0: head-major pages [pages, heads, page_size, dim]

    @property
    def token_shape(self) -> tuple[int, ...]:
        """The shape of one token's KV in this plane, as the host keeps it."""
        b = self.buffers[0]
        return (b.shape[1], b.shape[3]) if self.page_size else tuple(b.shape[1:])

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), *token_shape], a copy."""
        b = self.buffers[layer]
        if self.page_size:
            return b[slots // self.page_size, :, slots % self.page_size]
        return b[slots]

    def read_into(self, layer: int, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Gather straight into `out` (one pass where the layout allows it)."""
        if self.page_size:
            out.copy_(self.read(layer, slots))
        else:
            torch.index_select(self.buffers[layer], 0, slots, out=out)

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        b = self.buffers[layer]
        if self.page_size:
            b[slots // self.page_size, :, slots % self.page_size] = values
        else:
            b.index_copy_(0, slots, values)


@dataclass(frozen=True)
class KVLayout:
    name: str
    planes: tuple[Plane, ...]

    @property
    def layers(self) -> int:
        return len(self.planes[0].buffers)

    @property
    def dtype(self) -> torch.dtype:
        return self.planes[0].buffers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.planes[0].buffers[0].device

    @property
    def bytes_per_token(self) -> int:
        size = self.dtype.itemsize
        return sum(self.layers * size * _numel(p.token_shape) for p in self.planes)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of `src` slots into `dst` slots, every plane and layer: exact."""
        for plane in self.planes:
            for layer in range(self.layers):
                plane.write(layer, dst, plane.read(layer, src))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layout_of(pool) -> KVLayout:
    """The layout of one of SGLang's KV pools. Raises UnsupportedLayout naming it."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    kind = type(pool)
    if kind is MHATokenToKVPool:
        layout: Optional[str] = getattr(pool, "kv_cache_layout", "nhd")
        if any(getattr(pool, name, None) is not None for name in ("k_scale_buffer", "v_scale_buffer")):
            raise UnsupportedLayout(f"{kind.__name__} with per-token scale buffers (a quantized KV cache other "
                                    "than fp8): the session tree copies plain K and V only")
        if layout == "nhd" and not getattr(pool, "use_hnd", False):
            return KVLayout("mha-nhd", (Plane("k", tuple(pool.k_buffer)), Plane("v", tuple(pool.v_buffer))))
        if layout == "hnd":
            ps = pool.page_size
            return KVLayout("mha-hnd", (Plane("k", tuple(pool.k_buffer), ps), Plane("v", tuple(pool.v_buffer), ps)))
        raise UnsupportedLayout(f"{kind.__name__} with the {layout!r} KV layout: the session tree copies "
                                "token-major (nhd), head-major (hnd) and MLA pools only")
    if kind is MLATokenToKVPool:
        if getattr(pool, "use_dsa", False) or getattr(pool, "kv_scale_buffer", None) is not None:
            raise UnsupportedLayout(f"{kind.__name__} with DSA or scale buffers: the session tree copies plain "
                                    "MLA latents only")
        return KVLayout("mla", (Plane("latent", tuple(pool.kv_buffer)),))
    raise UnsupportedLayout(f"the {kind.__name__} KV pool: the session tree copies MHATokenToKVPool "
                            "(token- or head-major) and MLATokenToKVPool only")
