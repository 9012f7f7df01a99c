"""Copies of KV slots between SGLang's device pool and host memory, in any
layout `kv_layout` knows (token- or head-major MHA, MLA; FP8 as bytes).

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

from radix_ext.kv_layout import layout_of


@dataclass(frozen=True)
class HostKV:
    """The KV of consecutive tokens, one tensor per plane of the pool's layout
    (K and V, or MLA's latent), each [layers, tokens, *token_shape]."""

    planes: tuple[torch.Tensor, ...]

    @property
    def k(self) -> torch.Tensor:
        return self.planes[0]

    @property
    def v(self) -> torch.Tensor:
        return self.planes[1]

    def __len__(self) -> int:
        return self.planes[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)

    def narrow(self, start: int, n: int) -> "HostKV":
        """Tokens [start, start + n), as views."""
        return HostKV(tuple(p.narrow(1, start, n) for p in self.planes))

    def copy_(self, src: "HostKV") -> None:
        for mine, theirs in zip(self.planes, src.planes):
            mine.copy_(theirs)


class KVMover:
    """Moves slots of one of SGLang's KV pools (any layout of `kv_layout`) to
    host memory and back. Raises UnsupportedLayout for a pool it cannot copy."""

    def __init__(self, kv_pool):
        self.layout = layout_of(kv_pool)
        self.device = self.layout.device
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
        layout = self.layout
        return HostKV(tuple(torch.empty((layout.layers, num_tokens, *plane.token_shape), dtype=layout.dtype,
                                        pin_memory=self.pinned) for plane in layout.planes))

    def to_host(self, slots: torch.Tensor, out: HostKV) -> None:
        """Copy the KV in `slots` into `out`; complete when this returns."""
        assert len(out) == len(slots), f"{len(out)} host tokens for {len(slots)} slots"
        with self._on(self.to_host_stream):
            for plane, host in zip(self.layout.planes, out.planes):
                for layer in range(self.layout.layers):
                    if self.pinned:  # gather on the device, then one DMA into the pinned arena
                        host[layer].copy_(plane.read(layer, slots), non_blocking=True)
                    else:  # gather straight into the host arena
                        plane.read_into(layer, slots, host[layer])

    def to_device(self, host: HostKV, slots: torch.Tensor) -> None:
        """Write `host` into `slots`; the KV is in place when this returns."""
        assert len(host) == len(slots), f"{len(host)} host tokens for {len(slots)} slots"
        with self._on(self.to_device_stream):
            for plane, kv in zip(self.layout.planes, host.planes):
                for layer in range(self.layout.layers):
                    plane.write(layer, slots, kv[layer].to(self.device, non_blocking=True))

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
