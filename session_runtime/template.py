"""Chat templates: messages to token ids with typed spans.

Rendering is segment-wise: each message renders to a fixed run of tokens that
does not depend on what follows it, and an assistant message replays the exact
ids it was generated as. So the rendering of a history plus a new message
extends the rendering of the history, and a turn's generated sequence is a
prefix of the next turn's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from session_runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class Span:
    kind: str  # system, user, reasoning, answer, generation_prompt, ...
    start: int
    end: int


@dataclass(frozen=True)
class Message:
    role: str  # "user" or "assistant"
    content: str = ""
    reasoning: str = ""
    # Assistant only: the ids exactly as generated (reasoning, </think>, answer, eos).
    output_ids: tuple[int, ...] = ()


@dataclass
class Rendered:
    ids: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    def add(self, kind: str, ids: Sequence[int]) -> None:
        if ids:
            self.spans.append(Span(kind, len(self.ids), len(self.ids) + len(ids)))
            self.ids.extend(ids)


@dataclass(frozen=True)
class ParsedOutput:
    reasoning_ids: list[int]
    content_ids: list[int]
    ended: bool  # the model closed its answer (eos)


class DeepSeekTemplate:
    """DeepSeek V3.2 thinking format: <｜User｜>U<｜Assistant｜><think>R</think>A<eos>."""

    name = "deepseek"

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.bos = tok.token_id("<｜begin▁of▁sentence｜>")
        self.eos = tok.token_id("<｜end▁of▁sentence｜>")
        self.user = tok.token_id("<｜User｜>")
        self.assistant = tok.token_id("<｜Assistant｜>")
        self.think = tok.token_id("<think>")
        self.end_think = tok.token_id("</think>")

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos})

    def render(self, system: Optional[str], messages: Sequence[Message], generation_prompt: bool) -> Rendered:
        """Render a history. With `generation_prompt` the last message must be a user's."""
        out = Rendered()
        out.add("bos", [self.bos])
        if system:
            out.add("system", self.tok.encode(system))
        for msg in messages:
            if msg.role == "user":
                out.add("user", [self.user, *self.tok.encode(msg.content), self.assistant])
                out.add("generation_prompt", [self.think])
            else:
                self._render_assistant(out, msg)
        if not generation_prompt and messages and messages[-1].role == "user":
            # Without a generation prompt the history ends at the user's turn.
            out.ids.pop()
            out.spans.pop()
        return out

    def _render_assistant(self, out: Rendered, msg: Message) -> None:
        parsed = self.parse_output(msg.output_ids)
        out.add("reasoning", parsed.reasoning_ids)
        out.add("reasoning_end", [self.end_think] if self.end_think in msg.output_ids else [])
        out.add("answer", parsed.content_ids)
        out.add("eos", [self.eos])

    def forced_ids(self, reasoning: str, content: str) -> list[int]:
        """Token ids of an assistant output given as text (trace replay)."""
        return [*self.tok.encode(reasoning), self.end_think, *self.tok.encode(content), self.eos]

    def parse_output(self, ids: Sequence[int]) -> ParsedOutput:
        """Split generated ids into reasoning and answer; drops </think> and eos."""
        ids = list(ids)
        ended = bool(ids) and ids[-1] == self.eos
        if ended:
            ids = ids[:-1]
        if self.end_think in ids:
            cut = ids.index(self.end_think)
            return ParsedOutput(ids[:cut], ids[cut + 1 :], ended)
        return ParsedOutput(ids, [], ended)
