"""Copies of KV slots between SGLang's device pool and host memory.

SGLang's `MHATokenToKVPool.get_cpu_copy` / `load_cpu_copy` synchronise the
whole device before and after each copy, so a demotion stalls every other
conversation's step. `KVMover` copies on a stream of its own instead, into
pinned host buffers, and waits only for its own copy: a demotion or a reload
overlaps the compute stream's work for other conversations. Before copying it
waits for the work already queued on the compute stream (the KV it reads was
written there; the slots it writes may still be read by queued kernels).
On CPU the same code runs with plain host tensors and no stream.

Pinned buffers come from torch's caching host allocator, so after warm-up a
demotion pins no new memory; the host tier bounds how much is held. The bytes
moved are the pool's own, so a round trip is bit-identical (the tests compare
against `get_cpu_copy` as the oracle).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

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


class KVMover:
    """Moves slots of one MHATokenToKVPool to host memory and back."""

    def __init__(self, kv_pool):
        assert not getattr(kv_pool, "use_hnd", False), "KV offload indexes slots in NHD layout"
        self.k_buffer, self.v_buffer = kv_pool.k_buffer, kv_pool.v_buffer
        self.device = self.k_buffer[0].device
        self.pinned = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None

    def empty(self, num_tokens: int) -> HostKV:
        _, heads, dim = self.k_buffer[0].shape
        shape = (len(self.k_buffer), num_tokens, heads, dim)
        dtype = self.k_buffer[0].dtype
        return HostKV(torch.empty(shape, dtype=dtype, pin_memory=self.pinned),
                      torch.empty(shape, dtype=dtype, pin_memory=self.pinned))

    def to_host(self, slots: torch.Tensor) -> HostKV:
        """A host copy of the KV in `slots`, complete when this returns."""
        out = self.empty(len(slots))
        with self._copy_stream():
            for layer, (k, v) in enumerate(zip(self.k_buffer, self.v_buffer)):
                if self.pinned:  # gather on the device, then one DMA into the pinned buffer
                    out.k[layer].copy_(k[slots], non_blocking=True)
                    out.v[layer].copy_(v[slots], non_blocking=True)
                else:  # gather straight into the host buffer: one pass
                    torch.index_select(k, 0, slots, out=out.k[layer])
                    torch.index_select(v, 0, slots, out=out.v[layer])
        return out

    def to_device(self, host: HostKV, slots: torch.Tensor) -> None:
        """Write `host` into `slots`; the KV is in place when this returns."""
        assert len(host) == len(slots), f"{len(host)} host tokens for {len(slots)} slots"
        with self._copy_stream():
            for layer, (k, v) in enumerate(zip(self.k_buffer, self.v_buffer)):
                k.index_copy_(0, slots, host.k[layer].to(self.device, non_blocking=True))
                v.index_copy_(0, slots, host.v[layer].to(self.device, non_blocking=True))

    def join(self, head: HostKV, tail: HostKV) -> HostKV:
        """`head` then `tail`, as one host copy."""
        n = len(head)
        out = self.empty(n + len(tail))
        for dst, a, b in ((out.k, head.k, tail.k), (out.v, head.v, tail.v)):
            dst[:, :n].copy_(a)
            dst[:, n:].copy_(b)
        return out

    @contextmanager
    def _copy_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # this copy only: other streams' work goes on
