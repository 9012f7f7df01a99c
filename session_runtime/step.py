"""What a step returns to the caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from session_runtime.accounting import StepAccounting


@dataclass(frozen=True)
class Step:
    conversation_id: str
    turn: int
    step: int
    reasoning: str
    content: str
    tool_calls: list[dict]
    finish_reason: str  # stop, length, forced or tool_calls
    output_ids: list[int]
    logprobs: Optional[list[float]]
    accounting: StepAccounting
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per output token: (id, logprob), best first
    reasoning_tokens: int = 0  # output tokens before the answer: the reasoning and its end marker
    stop_sequence: Optional[str] = None  # the client's stop sequence the output ended on

    def as_dict(self) -> dict:
        return {
            "conversation_id": self.conversation_id, "turn": self.turn, "step": self.step,
            "reasoning": self.reasoning, "content": self.content, "tool_calls": self.tool_calls,
            "finish_reason": self.finish_reason, "logprobs": self.logprobs,
            **({"stop_sequence": self.stop_sequence} if self.stop_sequence is not None else {}),
            **({"top_logprobs": [[list(e) for e in row] for row in self.top_logprobs]} if self.top_logprobs else {}),
            "accounting": self.accounting.as_dict(),
        }
