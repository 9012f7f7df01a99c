"""Turn-level rules: the fork at a turn's close, cache states and counterfactuals.

Pure functions over token sequences and probe results; the Runtime applies them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from session_runtime.sequences import common_prefix  # noqa: F401  (the turn rules' own, re-exported)
from session_runtime.templates.base import KeepFrom

if TYPE_CHECKING:  # radix_ext.tree imports SGLang (seconds): the CLI parses its flags without it
    from radix_ext.tree import ProbeResult


def cache_state(cached: int, prev_prompt_tokens: Optional[int], prev_kind: str) -> str:
    """Which of the seed's four states served a turn's first step.

    prefix_only: nothing past the previous turn's prompt P was reused;
    generated_branch / canonical_branch: reuse went past P along that branch.
    """
    if cached == 0:
        return "none"
    # Reuse is exact up to the fork now (a private page holds its partial page),
    # so P itself is the bound, not its last whole page.
    if prev_prompt_tokens is None or cached <= prev_prompt_tokens:
        return "prefix_only"
    return "canonical_branch" if prev_kind == "canonical" else "generated_branch"


def counterfactual_entry(prompt: Sequence[int], probe: ProbeResult, shadow: Sequence[int] = ()) -> dict:
    """What a policy would pay for `prompt`: the tree's page-aligned reuse, or the
    policy's own chain (its token shadow: exact, a private last page included),
    whichever is longer. The last prompt token is always computed."""
    reused = max(probe.device_len, min(common_prefix(prompt, shadow), len(prompt) - 1))
    return {"prompt_tokens": len(prompt), "prefill_tokens": len(prompt) - reused, "context_tokens": len(prompt)}


keep_all = KeepFrom(float("-inf"))


def keep_from(turn: int) -> KeepFrom:
    return KeepFrom(turn)
