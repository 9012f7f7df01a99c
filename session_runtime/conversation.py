"""A conversation: its trace (every message as generated) and its history."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from session_runtime.accounting import StepAccounting
from session_runtime.template import Message


@dataclass(frozen=True)
class TraceEntry:
    """One message as it happened, with timings (DESIGN.md section 2, trace layer)."""

    turn: int
    role: str
    content: str
    reasoning: str = ""
    finish_reason: Optional[str] = None
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Step:
    """What a step returns to the caller."""

    conversation_id: str
    turn: int
    step: int
    reasoning: str
    content: str
    finish_reason: str
    output_ids: list[int]
    logprobs: Optional[list[float]]
    accounting: StepAccounting

    def as_dict(self) -> dict:
        return {
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "step": self.step,
            "reasoning": self.reasoning,
            "content": self.content,
            "tool_calls": [],
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "accounting": self.accounting.as_dict(),
        }


@dataclass
class Conversation:
    """Mutable state of one conversation; only the Runtime changes it, and only
    after a step has succeeded."""

    id: str
    system: Optional[str]
    tenant: Optional[str]
    history: list[Message] = field(default_factory=list)  # canonical history
    trace: list[TraceEntry] = field(default_factory=list)
    turns: list[list[StepAccounting]] = field(default_factory=list)
    chain_tokens: list[int] = field(default_factory=list)  # the computed sequence

    @property
    def turn_count(self) -> int:
        return len(self.turns)
