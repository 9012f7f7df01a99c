"""One chunk of one sequence as the decoder and its attention backends see it
(below both: model/attention.py reads it, model/decoder.py builds it)."""

from __future__ import annotations

import torch


class ForwardBatch:
    """One chunk of one sequence: where its K/V go and what it attends over."""

    __slots__ = ("kv_pool", "positions", "out_slots", "ctx_slots")

    def __init__(self, kv_pool, positions: torch.Tensor, out_slots: torch.Tensor, ctx_slots: torch.Tensor):
        self.kv_pool = kv_pool
        self.positions = positions
        self.out_slots = out_slots
        self.ctx_slots = ctx_slots
        assert len(out_slots) == len(positions), "one output slot per new token"
        assert int(positions[-1]) == len(ctx_slots) - 1, "the new tokens must end the context"
