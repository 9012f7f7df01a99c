"""Messages, typed spans and the template contract.

Rendering is segment-wise: each message renders to a run of tokens fixed by
the message and by whether its turn keeps its reasoning, never by what comes
after it. Assistant messages replay the ids they were generated as, so inside
an open turn the rendering is exactly the generated sequence, and the only
place a rendering changes is where a closed turn drops its reasoning.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol, Sequence

from session_runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def as_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Message:
    role: str  # "user", "assistant" or "tool"
    turn: int
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""  # tool messages: the call they answer
    output_ids: tuple[int, ...] = ()  # assistant: the ids exactly as generated
    # Upstream proxy mode, assistant: the provider's message as it came back
    # ({"protocol", "message"} as JSON): its continuation state (signatures,
    # encrypted reasoning, call ids, `content: null`) goes back byte-identical.
    wire: str = ""


@dataclass(frozen=True)
class Span:
    kind: str  # bos, system, user, think_open, think_skip, reasoning, answer, tool_call, tool_result, eos
    start: int
    end: int


@dataclass
class Rendered:
    ids: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    def add(self, kind: str, ids: Sequence[int]) -> None:
        if ids:
            self.spans.append(Span(kind, len(self.ids), len(self.ids) + len(ids)))
            self.ids.extend(ids)

    def length_of(self, kind: str) -> int:
        return sum(s.end - s.start for s in self.spans if s.kind == kind)


@dataclass(frozen=True)
class ParsedOutput:
    reasoning_ids: list[int]
    answer_ids: list[int]  # everything after the reasoning: content and tool-call text
    content: str
    tool_calls: tuple[ToolCall, ...]
    ended: bool  # the output closed with eos
    reasoning: str = ""  # the reasoning as text, without the template's markers

    def reasoning_tokens(self, output_len: int) -> int:
        """Of the `output_len` tokens parsed, the reasoning's (its markers
        included): neither the answer nor the closing eos."""
        return output_len - len(self.answer_ids) - int(self.ended)


KeepReasoning = Callable[[int], bool]  # turn index -> does that turn keep its reasoning?


@dataclass(frozen=True)
class KeepFrom:
    """A KeepReasoning: the turns from `first` on keep their reasoning. Said as
    a threshold, a renderer finds where keeping starts in a history without
    asking each message (render_cache.py)."""

    first: float

    def __call__(self, turn: int) -> bool:
        return turn >= self.first


@dataclass(frozen=True)
class KeepChosen:
    """A KeepReasoning for turns chosen one by one (policy `auto`): the turns in
    `kept`, and every turn from `open_from` (the open turn) on. Not a threshold:
    a renderer asks it per message."""

    kept: frozenset
    open_from: int

    def __call__(self, turn: int) -> bool:
        return turn >= self.open_from or turn in self.kept


def keep_chosen(kept: frozenset, open_from: int) -> KeepReasoning:
    """The turns in `kept` and those from `open_from` on: a threshold (KeepFrom)
    where `kept` is a run that ends just before `open_from`, so renderers find
    where keeping starts by bisection."""
    low = open_from - len(kept)
    if all(low <= t < open_from for t in kept):
        return KeepFrom(low)
    return KeepChosen(frozenset(kept), open_from)


_turn = operator.attrgetter("turn")


def keeping_starts(keep: KeepReasoning, messages: Sequence[Message]) -> Optional[int]:
    """The index of the first message whose turn keeps its reasoning, when `keep`
    is a threshold (KeepFrom) and the messages are in turn order: one bisection
    in C instead of a call per message. None otherwise (ask `keep` per message)."""
    first = getattr(keep, "first", None)
    if first is None or not in_turn_order(messages):
        return None
    return bisect.bisect_left(messages, first, key=_turn)


def in_turn_order(messages: Sequence[Message]) -> bool:
    """Are the messages' turns non-decreasing (compared in C)."""
    turns = list(map(_turn, messages))
    return all(map(operator.le, turns, turns[1:]))


def message_groups(messages: Sequence[Message]) -> Iterator[tuple[str, list[Message]]]:
    """(role, messages) in order, one group per user or assistant message and one
    per run of tool results (they answer one assistant message's calls together)."""
    i = 0
    while i < len(messages):
        role = messages[i].role
        if role not in ("user", "assistant", "tool"):
            raise ValueError(f"unknown role {role!r}")
        j = i + 1
        while role == "tool" and j < len(messages) and messages[j].role == "tool":
            j += 1
        yield role, list(messages[i:j])
        i = j


class Template(Protocol):
    name: str
    tok: Tokenizer
    call_marker: str

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    def render(
        self,
        system: Optional[str],
        tools: Sequence[dict],
        messages: Sequence[Message],
        keep: KeepReasoning,
        generation_prompt: bool,
    ) -> Rendered: ...

    def rendered_length(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
                        keep: KeepReasoning, generation_prompt: bool) -> int:
        """len(render(...).ids); where the template keeps renderings, without a copy."""
        ...

    def parse_output(self, ids: Sequence[int], call_id_base: str) -> ParsedOutput: ...

    def forced_ids(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall]) -> list[int]: ...

    def strip_reasoning(self, msg: Message) -> Message: ...


def tool_schema(tool: dict) -> dict:
    """Accept OpenAI's {"type": "function", "function": {...}} or the bare function."""
    return tool.get("function", tool) if isinstance(tool, dict) else tool
