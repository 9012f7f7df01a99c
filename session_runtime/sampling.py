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
    top_p: float = 1.0  # nucleus sampling: draw from the fewest tokens whose probability reaches top_p
    top_k: int = 0  # draw from the k most likely tokens only (0: all)
    seed: Optional[int] = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely tokens at each position, and theirs
    stop: tuple[str, ...] = ()  # stop sequences: the output ends where one appears (constrained/)
    grammar: Optional[str] = None  # an xgrammar structural tag the answer follows (constrained/grammar.py)
    # The output starts inside the reasoning block, which this token ends (None: it
    # starts after it); the grammar applies from there. think_budget: the block's
    # tokens at most, then this token comes (None: up to max_tokens).
    think_end: Optional[int] = None
    think_budget: Optional[int] = None

    @property
    def constrained(self) -> bool:
        """Does the output follow a grammar, a bounded reasoning block or stop sequences?"""
        return self.grammar is not None or self.think_end is not None or bool(self.stop)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest(f"top_logprobs must be 0 to 20, got {self.top_logprobs}", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs", param="top_logprobs")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0, got {self.top_k!r}", param="top_k")
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
        if self.params.top_k:
            probs = _top_k(probs, self.params.top_k)
        if self.params.top_p < 1.0:
            probs = _nucleus(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """`probs` kept on the `k` most likely tokens (ties at the k-th kept too),
    zero elsewhere, summing to 1 again (top_p then applies to what is left, as
    SGLang orders them)."""
    if k >= probs.shape[-1]:
        return probs
    kept = torch.where(probs >= torch.topk(probs, k).values[-1], probs, torch.zeros_like(probs))
    return kept / kept.sum()


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` kept on the most likely tokens whose total first reaches `top_p`
    (the token that crosses it included), zero elsewhere."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ahead of each
    sorted_probs[before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def token_logprob(logits: torch.Tensor, token: int) -> float:
    return float(torch.log_softmax(logits, dim=-1)[token])


def top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens at a position and their logprobs, best first."""
    values, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k)
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
