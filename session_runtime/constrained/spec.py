"""What a request constrains in its output, whatever protocol it came in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import ParsedOutput

MAX_STOP_CHARS = 256  # one stop sequence's length
# The share of the output cap the reasoning may take at each effort that bounds
# it (none and minimal: thinking off, the reasoning block closed at once); at
# the others (medium, high, ...) the model reasons as it would, up to the cap.
EFFORT_SHARE = {"none": 0.0, "minimal": 0.0, "low": 0.25}


@dataclass(frozen=True)
class OutputConstraint:
    """`call`: the step must call a tool, one of `tools` (a named tool choice
    is one; none named: any tool of the conversation); `no_call`: it must not;
    `answer_schema`: the answer is JSON text that this JSON schema (JSON text)
    accepts (JSON mode: `{"type": "object"}`; with tools and neither, a call
    is the other choice); `stop`: the output ends where one of these strings
    appears; `think_budget` / `effort`: the reasoning's bound. `*_field` names
    each part's field in the request, for errors."""

    call: bool = False
    no_call: bool = False  # tool_choice none with tools: the step answers, the tools stay in the prompt
    tools: tuple[str, ...] = ()
    answer_schema: Optional[str] = None
    stop: tuple[str, ...] = ()
    think_budget: Optional[int] = None  # the reasoning's tokens at most (Anthropic's budget_tokens, 0: off)
    effort: Optional[str] = None  # the protocol's reasoning effort, where it bounds the reasoning (EFFORT_SHARE)
    tools_field: str = "tool_choice"
    schema_field: str = "response_format"

    @property
    def shapes_output(self) -> bool:
        """Does the output's shape follow a grammar (a forced call or a schema)?"""
        return self.call or self.no_call or self.answer_schema is not None

    @property
    def needs_grammar(self) -> bool:
        """A grammar shapes the output or bounds the reasoning (stop sequences need none)."""
        return self.shapes_output or self.think_budget is not None or self.effort in EFFORT_SHARE

    def reasoning_budget(self, cap: int) -> Optional[int]:
        """The reasoning's tokens at most for a step of `cap` output tokens:
        the request's budget, its effort's share of the cap, or half the cap
        before a call or an answer in a schema (which need room after it);
        None: unbounded but by the cap."""
        room = self.call or self.answer_schema is not None
        if self.think_budget is not None:  # one at or past the cap bounds nothing the cap does not
            return self.think_budget if self.think_budget < cap else (cap // 2 if room else None)
        if self.effort in EFFORT_SHARE:
            return int(cap * EFFORT_SHARE[self.effort])
        return cap // 2 if room else None


NONE = OutputConstraint()


def stop_sequences(value: object, field: str, limit: int) -> tuple[str, ...]:
    """A request's stop sequences (a string or a list of strings), checked:
    InvalidRequest naming `field` for another type, an empty string, one longer
    than MAX_STOP_CHARS, or more than `limit`."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest(f"{field}: expected a string or a list of strings", param=field)
    if len(items) > limit:
        raise InvalidRequest(f"{field}: at most {limit} stop sequences, got {len(items)}", param=field)
    for s in items:
        if not s:
            raise InvalidRequest(f"{field}: a stop sequence is empty", param=field)
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"{field}: a stop sequence is longer than {MAX_STOP_CHARS} characters", param=field)
    return tuple(dict.fromkeys(items))


def cut_at_stop(parsed: ParsedOutput, stop: str) -> ParsedOutput:
    """The parsed output as the client sees it when it ended on `stop`: its
    text up to the stop sequence (in the answer, or in the reasoning when it
    came there first, with no answer then)."""
    if stop in parsed.reasoning:
        return dataclasses.replace(parsed, reasoning=parsed.reasoning[: parsed.reasoning.index(stop)], content="",
                                   tool_calls=())
    at = parsed.content.find(stop)
    return dataclasses.replace(parsed, content=parsed.content[:at]) if at >= 0 else parsed
