"""Per-step accounting (DESIGN.md section 6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from session_runtime.protocols.base import clone


@dataclass(frozen=True)
class StepAccounting:
    prompt_tokens: int
    cached_input_tokens: Optional[int]  # prompt tokens whose KV was reused (upstream: as the provider says, None if not)
    host_loaded_tokens: int  # reused by reload from the host tier
    uncached_prefill_tokens: Optional[int]  # prompt tokens computed in this step's prefill (None: not known)
    logical_reusable_tokens: int  # exact common prefix with held sequences, unaligned
    alignment_loss_tokens: int  # logical reusable minus physically reused
    recomputed_history_tokens: int  # prefill spent on tokens before the new message
    active_context_length: int  # tokens the next step starts from
    output_tokens: int
    kv_device_bytes: int  # this conversation's chain on the device
    kv_host_bytes: int
    prefill_ms: float
    ttft_ms: float
    tpot_ms: float
    attention_work: int  # q*H + q*(q+1)/2 for q prefilled tokens on H reused
    # A turn's first step only: which branch served it, and keep vs drop probed
    # on the tree as it was before the step.
    cache_state: Optional[str] = None  # none, prefix_only, generated_branch, canonical_branch
    counterfactual: Optional[dict] = None  # {keep: {...}, drop: {...}}
    # Upstream proxy mode: the provider's usage, and what the outbound stripper
    # did (tokens and bytes stripped, the reasoning share of the request).
    upstream: Optional[dict] = None
    # Why each uncached prompt token was prefilled: [{reason, tokens}] summing to
    # uncached_prefill_tokens (uncached.py); None where that is not known (upstream).
    uncached: Optional[list] = None
    # A stateless step: which of its protocol's rules decided its prompt, e.g.
    # {"reasoning": {"rule": "clear_thinking_20251015", "policy": "keep_last_k",
    # "keep_last_k": 1}, "tool_uses": {"rule": "clear_tool_uses_20250919",
    # "cleared": 4}}; None for a step a client's conversation ran.
    rules: Optional[dict] = None

    def as_dict(self) -> dict:
        """Every field; nested dicts and lists copied, as `dataclasses.asdict`
        would (which costs ~5x as much: it is on every step's response)."""
        return plain_dict(self)


_NAMES: dict[type, tuple[str, ...]] = {}


def plain_dict(obj) -> dict:
    """`dataclasses.asdict` of a dataclass whose fields hold plain values (not
    dataclasses): every field, nested dicts and lists copied, at a fifth of the cost."""
    names = _NAMES.get(type(obj))
    if names is None:
        names = _NAMES.setdefault(type(obj), tuple(f.name for f in dataclasses.fields(obj)))
    return {name: clone(getattr(obj, name)) for name in names}


def attention_work(prefilled: int, reused: int) -> int:
    return prefilled * reused + prefilled * (prefilled + 1) // 2
