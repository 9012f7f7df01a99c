"""Copies of KV slots between SGLang's device pool and host memory.

SGLang's `MHATokenToKVPool.get_cpu_copy` / `load_cpu_copy` synchronise the
whole device before and after each copy, so a demotion stalls every other
conversation's step. `KVMover` copies on streams of its own (one per
direction, as the GPU has a copy engine each way), between the device pool and
a pinned host arena, and waits only for its own copy: a demotion or a reload
overlaps the compute stream's work for other conversations. Before copying it
waits for the work already queued on the compute stream (the KV it reads was
written there; the slots it writes may still be read by queued kernels).
On CPU the same code runs with plain host tensors and no streams.

The bytes moved are the pool's own, so a round trip is bit-identical (the
tests compare against `get_cpu_copy` as the oracle).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class HostKV:
    """K and V of consecutive tokens, per layer: [layers, tokens, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def narrow(self, start: int, n: int) -> "HostKV":
        """Tokens [start, start + n), as views."""
        return HostKV(self.k.narrow(1, start, n), self.v.narrow(1, start, n))

    def copy_(self, src: "HostKV") -> None:
        self.k.copy_(src.k)
        self.v.copy_(src.v)


class KVMover:
    """Moves slots of one MHATokenToKVPool to host memory and back."""

    def __init__(self, kv_pool):
        assert not getattr(kv_pool, "use_hnd", False), "KV offload indexes slots in NHD layout"
        self.k_buffer, self.v_buffer = kv_pool.k_buffer, kv_pool.v_buffer
        self.device = self.k_buffer[0].device
        self.pinned = self.device.type == "cuda"
        if self.pinned:
            self.compute: Optional[torch.cuda.Stream] = torch.cuda.current_stream(self.device)
            self.to_host_stream = torch.cuda.Stream(self.device)
            self.to_device_stream = torch.cuda.Stream(self.device)
        else:
            self.compute = self.to_host_stream = self.to_device_stream = None

    def empty(self, num_tokens: int) -> HostKV:
        """A host arena for `num_tokens` (pinned on CUDA). On CPU the pages are
        committed by the OS only as copies write them."""
        _, heads, dim = self.k_buffer[0].shape
        shape = (len(self.k_buffer), num_tokens, heads, dim)
        dtype = self.k_buffer[0].dtype
        return HostKV(torch.empty(shape, dtype=dtype, pin_memory=self.pinned),
                      torch.empty(shape, dtype=dtype, pin_memory=self.pinned))

    def to_host(self, slots: torch.Tensor, out: HostKV) -> None:
        """Copy the KV in `slots` into `out`; complete when this returns."""
        assert len(out) == len(slots), f"{len(out)} host tokens for {len(slots)} slots"
        with self._on(self.to_host_stream):
            for layer, (k, v) in enumerate(zip(self.k_buffer, self.v_buffer)):
                if self.pinned:  # gather on the device, then one DMA into the pinned arena
                    out.k[layer].copy_(k[slots], non_blocking=True)
                    out.v[layer].copy_(v[slots], non_blocking=True)
                else:  # gather straight into the host arena: one pass
                    torch.index_select(k, 0, slots, out=out.k[layer])
                    torch.index_select(v, 0, slots, out=out.v[layer])

    def to_device(self, host: HostKV, slots: torch.Tensor) -> None:
        """Write `host` into `slots`; the KV is in place when this returns."""
        assert len(host) == len(slots), f"{len(host)} host tokens for {len(slots)} slots"
        with self._on(self.to_device_stream):
            for layer, (k, v) in enumerate(zip(self.k_buffer, self.v_buffer)):
                k.index_copy_(0, slots, host.k[layer].to(self.device, non_blocking=True))
                v.index_copy_(0, slots, host.v[layer].to(self.device, non_blocking=True))

    @contextmanager
    def _on(self, stream: Optional[torch.cuda.Stream]) -> Iterator[None]:
        if stream is None:
            yield
            return
        stream.wait_stream(self.compute)
        done = torch.cuda.Event()
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            # Also on error: what was queued must finish before the caller frees
            # the slots or the host range it reads.
            done.record(stream)
            done.synchronize()  # this copy only: other streams' work goes on
