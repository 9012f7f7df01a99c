"""Why each uncached prompt token was prefilled (DESIGN.md section 6).

A step's prompt is cut into its reused prefix and the uncached rest; the rest
is cut by what the runtime knew of the conversation before the step (`Known`):

- tokens this runtime computed for the conversation (the previous step's fed
  sequence, or the whole history when a canonical branch or a previous run
  computed it) that were not reused were lost, and `Known.lost` says how
  (`evicted`, `discarded`, `backend_lost`); of a `backend_lost` run, the first
  `alignment_loss` are held on the new worker but sit in a page it could not
  share (`page_alignment`: a token that fits two reasons takes the first in
  the order of REASONS, which puts evicted and discarded before it); what a
  baseline policy never caches (its output) is `policy_fork`;
- history past what was computed: never computed for this conversation, and
  `Known.diverged` says why (`first_seen`, `policy_fork`, `tool_uses_cleared`:
  tool uses the request cleared from the prompt, `history_replaced`);
- the step's own input (`new_input`): its new messages with the template's
  markup and the generation prompt; where the prompt continues the whole
  previous sequence, everything past it is new input (the previous step's
  last sampled token, which no step had fed, included).

The regions do not overlap, so a token has one reason; they cover the
uncached rest exactly, so the tokens sum to `uncached_prefill_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.turns import common_prefix

REASONS = ("new_input", "first_seen", "policy_fork", "tool_uses_cleared", "evicted", "discarded", "page_alignment",
           "backend_lost", "history_replaced")
DIVERGED = ("first_seen", "policy_fork", "tool_uses_cleared", "history_replaced")
LOST = ("evicted", "discarded", "backend_lost")


@dataclass(frozen=True)
class Known:
    """What the runtime knew of a conversation's KV before a step."""

    sequence: Sequence[int] = ()  # the last sequence whose KV a step computed
    history_computed: bool = False  # the whole history was computed (canonical branch, a previous run)
    diverged: str = "first_seen"  # why history past `sequence` was never computed
    lost: str = "evicted"  # why computed KV is not there
    kept: Optional[int] = None  # of `sequence`, the tokens the policy caches (None: all of them)

    def __post_init__(self) -> None:
        assert self.diverged in DIVERGED and self.lost in LOST, (self.diverged, self.lost)


def attribute(prompt: Sequence[int], history_len: int, uncached: int, alignment_loss: int,
              known: Known) -> list[dict]:
    """`[{"reason", "tokens"}]` for the step's `uncached` prompt tokens (the
    last `uncached` of `prompt`), in the order of REASONS, zeros left out."""
    n = len(prompt)
    reused = n - max(0, min(uncached, n))
    history = min(history_len, n)
    computed = common_prefix(prompt, known.sequence)
    if known.history_computed:
        computed = new_from = max(computed, history)
    elif known.sequence and computed == len(known.sequence):
        new_from = computed  # the prompt continues the whole sequence: the rest is this step's
    else:
        new_from = history
    computed = min(computed, new_from)
    counts = dict.fromkeys(REASONS, 0)
    lost_end = computed
    if known.kept is not None and reused < computed and known.kept < computed:
        lost_end = max(reused, known.kept)  # a baseline that never caches its output
        counts["policy_fork"] += computed - lost_end
    lost = max(0, lost_end - reused)
    # Held, but in a page it could not share: unless the loss comes first in the
    # order of REASONS (a token that fits two reasons takes the first).
    first = REASONS.index(known.lost) < REASONS.index("page_alignment")
    aligned = 0 if first else min(lost, max(0, alignment_loss))
    counts["page_alignment"] += aligned
    counts[known.lost] += lost - aligned
    counts[known.diverged] += max(0, new_from - max(reused, computed))
    counts["new_input"] += n - max(reused, new_from)
    return [{"reason": r, "tokens": t} for r, t in counts.items() if t]


def totals(rows: Sequence[Optional[list[dict]]]) -> dict[str, int]:
    """Tokens per reason over steps (None: a step whose uncached tokens are not known)."""
    out: dict[str, int] = {}
    for row in rows:
        for entry in row or ():
            out[entry["reason"]] = out.get(entry["reason"], 0) + entry["tokens"]
    return {r: out[r] for r in REASONS if r in out}
