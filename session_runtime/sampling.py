"""Sampling parameters and the token sampler (greedy, temperature with a seed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from session_runtime.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 (or below 1e-5) means greedy
    seed: Optional[int] = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest(f"seed must fit in 64 bits, got {self.seed}")


class Sampler:
    """Draws tokens for one step; seeded so a replay draws the same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = None
        if params.temperature >= 1e-5:  # below that, softmax(logits / t) is argmax anyway
            self.generator = torch.Generator().manual_seed((params.seed or 0) % 2**63)

    def sample(self, logits: torch.Tensor) -> int:
        """`logits` is [vocab] float32 on any device."""
        if self.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.cpu().double() / self.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def token_logprob(logits: torch.Tensor, token: int) -> float:
    return float(torch.log_softmax(logits, dim=-1)[token])
