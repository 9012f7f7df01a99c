"""Attention over SGLang's paged KV pool, behind one small interface.

The decoder writes each layer's new K/V into the pool itself, then asks a
backend to attend: `begin(batch)` once per forward (the plan, shared by all
layers), `attend(q, keys, values)` per layer with that layer's pool buffers.

- `SdpaAttention`: gathers the context's K/V by slot and runs torch SDPA
  (CPU, and CUDA where flashinfer cannot run).
- `FlashInferAttention`: flashinfer's paged prefill kernel, reading the pool's
  pages in place (CUDA only; `flashinfer` is imported only here, lazily).
- `PagedReferenceAttention`: flashinfer's paged semantics in plain torch, the
  CPU oracle for the page metadata both share.

A sequence's slots are page-contiguous: the engine reuses only page-aligned
prefixes and allocates whole pages, so page i of the context is the pool's
slots `page_id * ps + arange(ps)`. That is what lets flashinfer read the pool's
per-layer buffer `[slots, heads, dim]` as `[pages, ps, heads, dim]` (NHD).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from session_runtime.config import ATTENTION_BACKENDS, ModelConfig
from session_runtime.errors import InvalidRequest

if TYPE_CHECKING:
    from session_runtime.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# flashinfer's scratch space for split-KV partial outputs. One sequence needs
# about 17 MB on a 132-SM GPU for the presets' shapes; SGLang sizes 384-512 MB
# for whole batches.
WORKSPACE_BYTES = 128 * 1024 * 1024


class AttentionUnavailable(InvalidRequest):
    """The asked-for attention backend cannot run here (no CUDA, no flashinfer,
    a dtype or GPU its kernels do not support)."""


class AttentionBackend(Protocol):
    name: str

    def begin(self, batch: "ForwardBatch") -> None:
        """Prepare for one forward over `batch`; every layer's `attend` reuses it."""

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [q_len, heads, dim] over one layer's pool buffers [slots, kv_heads, dim];
        returns [q_len, heads, dim]."""


@dataclass(frozen=True)
class PagedMetadata:
    """flashinfer's paged description of one sequence: q_len queries that end a
    context of pages `kv_indices`, the last holding `kv_last_page_len` tokens."""

    page_size: int
    qo_indptr: torch.Tensor  # int32 [0, q_len], host
    kv_indptr: torch.Tensor  # int32 [0, num_pages], host
    kv_indices: torch.Tensor  # int32 page ids, on the slots' device
    kv_last_page_len: torch.Tensor  # int32 [tokens on the last page], host


def paged_metadata(ctx_slots: torch.Tensor, q_len: int, page_size: int) -> PagedMetadata:
    """Page metadata of a context given by its slots. Raises ValueError when the
    slots are not whole pages in order (a page's slots must be consecutive and
    start on a page boundary; only the last page may be partial)."""
    n = len(ctx_slots)
    if not 0 < q_len <= n:
        raise ValueError(f"{q_len} queries cannot end a context of {n} slots")
    pages = ctx_slots[::page_size] // page_size
    offsets = torch.arange(page_size, device=ctx_slots.device)
    expected = (pages[:, None] * page_size + offsets).flatten()[:n]
    if not torch.equal(expected, ctx_slots):
        raise ValueError(f"context slots are not page-contiguous for page size {page_size}")
    num_pages = len(pages)
    return PagedMetadata(
        page_size=page_size,
        qo_indptr=torch.tensor([0, q_len], dtype=torch.int32),
        kv_indptr=torch.tensor([0, num_pages], dtype=torch.int32),
        kv_indices=pages.to(torch.int32),
        kv_last_page_len=torch.tensor([n - (num_pages - 1) * page_size], dtype=torch.int32),
    )


class SdpaAttention:
    """Gather the context's K/V by slot; torch SDPA with an explicit causal mask."""

    name = "sdpa"

    def begin(self, batch: "ForwardBatch") -> None:
        self._ctx_slots = batch.ctx_slots
        positions, n_ctx = batch.positions, len(batch.ctx_slots)
        if len(positions) == 1:
            self._mask = None  # a single query sees the whole context
        else:
            # Query i sits at position positions[i] and may see keys 0..positions[i].
            key_pos = torch.arange(n_ctx, device=positions.device)
            self._mask = (key_pos[None, :] <= positions[:, None])[None, None]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        keys, values = keys[self._ctx_slots], values[self._ctx_slots]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=self._mask,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
        return out.squeeze(0).transpose(0, 1)


class _PagedAttention:
    """A backend that plans from page metadata and reads the pool as pages."""

    def begin(self, batch: "ForwardBatch") -> None:
        self.plan(paged_metadata(batch.ctx_slots, len(batch.positions), batch.kv_pool.page_size))

    def plan(self, meta: PagedMetadata) -> None:
        self._meta = meta

    def _pages(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(-1, self._meta.page_size, *buffer.shape[1:])


class PagedReferenceAttention(_PagedAttention):
    """flashinfer's paged prefill semantics in plain float32 torch: K/V read
    through kv_indptr/kv_indices/kv_last_page_len, query head h uses kv head
    h // group, and the causal mask is aligned to the end of the context."""

    name = "paged-reference"

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        meta = self._meta
        assert len(meta.qo_indptr) == 2, "one sequence per forward"
        q_len = int(meta.qo_indptr[1] - meta.qo_indptr[0])
        pages = meta.kv_indices[int(meta.kv_indptr[0]) : int(meta.kv_indptr[1])]
        kv_len = (len(pages) - 1) * meta.page_size + int(meta.kv_last_page_len[0])
        k = self._pages(keys)[pages].flatten(0, 1)[:kv_len].float()
        v = self._pages(values)[pages].flatten(0, 1)[:kv_len].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * q.shape[-1] ** -0.5
        # Bottom-right aligned: query i is context position kv_len - q_len + i.
        key_pos, query_pos = torch.arange(kv_len, device=q.device), torch.arange(q_len, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None] + (kv_len - q_len)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


class FlashInferAttention(_PagedAttention):
    """flashinfer's BatchPrefillWithPagedKVCacheWrapper over the pool's pages
    (NHD), causal; q_len 1 is decode. Plans once per forward on the host.
    Raises ImportError when flashinfer is not installed."""

    name = "flashinfer"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dtype = dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # FA2 kernels, as SGLang's flashinfer backend pins them ("auto" would pick FA3 on Hopper).
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")

    def plan(self, meta: PagedMetadata) -> None:
        super().plan(meta)
        self._wrapper.plan(
            meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, meta.page_size,
            causal=True, sm_scale=self.head_dim ** -0.5,
            q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, (self._pages(keys), self._pages(values)))


def _smoke_test(backend: FlashInferAttention, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """One tiny plan+run: 3 queries over 20 tokens on pages [2, 0] of 16, checked
    against the paged reference. Raises on any failure or mismatch."""
    ps, gen = 16, torch.Generator(device=device).manual_seed(0)
    kv_shape = (3 * ps, cfg.num_kv_heads, cfg.head_dim)
    keys, values = (torch.randn(kv_shape, generator=gen, device=device, dtype=dtype) for _ in range(2))
    q = torch.randn((3, cfg.num_heads, cfg.head_dim), generator=gen, device=device, dtype=dtype)
    slots = torch.cat((torch.arange(2 * ps, 3 * ps), torch.arange(4))).to(device)
    meta = paged_metadata(slots, 3, ps)
    reference = PagedReferenceAttention()
    for b in (backend, reference):
        b.plan(meta)
    out, ref = backend.attend(q, keys, values).float(), reference.attend(q, keys, values).float()
    err = float((out - ref).abs().max() / ref.abs().max())
    if not err < 2e-2:
        raise RuntimeError(f"output differs from the paged reference (relative error {err:.3g})")


def _flashinfer(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> FlashInferAttention:
    if device.type != "cuda":
        raise AttentionUnavailable(f"flashinfer runs on cuda only, the device is {device}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise AttentionUnavailable(f"flashinfer needs float16 or bfloat16, the dtype is {dtype}")
    try:
        backend = FlashInferAttention(cfg, dtype, device)
        _smoke_test(backend, cfg, dtype, device)
    except Exception as exc:  # an import, JIT build or kernel failure: all mean "cannot run here"
        raise AttentionUnavailable(f"flashinfer failed its smoke test: {exc!r}") from exc
    return backend


def make_attention(name: str, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> AttentionBackend:
    """The backend called `name` (see ATTENTION_BACKENDS) for a model of shape
    `cfg`. "auto" is flashinfer on cuda when it imports and passes a smoke test,
    else SDPA (with a warning on cuda). Raises AttentionUnavailable when
    "flashinfer" cannot run here, ValueError for an unknown name."""
    device = torch.device(device)
    if name == "sdpa":
        return SdpaAttention()
    if name == "paged-reference":
        return PagedReferenceAttention()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "flashinfer":
        return _flashinfer(cfg, dtype, device)
    if device.type != "cuda":
        return SdpaAttention()  # flashinfer is CUDA-only: never import it on a CPU run
    try:
        return _flashinfer(cfg, dtype, device)
    except AttentionUnavailable as exc:
        logger.warning("attention auto: using sdpa because %s", exc)
        return SdpaAttention()
