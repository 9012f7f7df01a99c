"""What a request constrains in its output, whatever protocol it came in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import ParsedOutput

MAX_STOP_CHARS = 256  # one stop sequence's length


@dataclass(frozen=True)
class OutputConstraint:
    """`tools`: the step must call one of these tools (a named tool choice is
    one, `required` / `any` every tool of the request); `answer_schema`: the
    answer is JSON text that this JSON schema (JSON text) accepts (JSON mode:
    `{"type": "object"}`); `stop`: the output ends where one of these strings
    appears. `*_field` names each part's field in the request, for errors."""

    tools: tuple[str, ...] = ()
    answer_schema: Optional[str] = None
    stop: tuple[str, ...] = ()
    think_budget: Optional[int] = None  # reasoning tokens before a constrained answer; None: half the output cap
    tools_field: str = "tool_choice"
    schema_field: str = "response_format"

    @property
    def shapes_output(self) -> bool:
        """Is a grammar needed (a forced call or a schema), beyond stop sequences?"""
        return bool(self.tools) or self.answer_schema is not None


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
