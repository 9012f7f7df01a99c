"""What each request's prompt is made of, and the seed's reasoning-share figures.

Every request of a replayed trace (a step: the user message or tool results
that opened it, and everything before) is rendered by the conversation's chat
template under `keep` (every turn's reasoning) or `drop` (only the open turn's),
exactly as the runtime renders that policy's prompts, and its typed spans
(`Rendered.spans`) are summed into categories:

- system: the begin-of-sequence token, the system prompt and the tool schemas;
- user: user messages with their role markup;
- reasoning: reasoning tokens of assistant messages (their think markers are markup);
- answer: an assistant message's content, up to where its tool-call markup starts;
- tool_call: the tool-call markup (the template's `call_marker` onwards);
- tool_result: tool results with their markup;
- markup: the rest: think-block markers, generation prompts, end-of-message tokens.

The reasoning share (seed 004, there counted in characters, here in tokens):

    lastView = reasoning tokens in the last request's prompt / that prompt's tokens
    burden   = sum over blocks b of |R_b| * n_b / sum over all prompt tokens of
               their own n, where n is the number of requests that carry the token
             = sum over requests r of reasoning(r) / sum over requests r of prompt(r)

so burden weights each reasoning block by the number of later requests that
carry it (under keep, every later request; under drop, the later steps of its
own turn), against everything those requests send, system prompt included.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

from session_runtime.templates import Message, Template
from session_runtime import turns as turn_rules

CATEGORIES = ("system", "user", "reasoning", "answer", "tool_call", "tool_result", "markup")
RENDERINGS = ("keep", "drop")
_KIND = {"bos": "system", "system": "system", "user": "user", "tool_result": "tool_result", "reasoning": "reasoning"}


@dataclass(frozen=True)
class Composition:
    """One request's prompt, in tokens per category; `turn` and `step` 0-based."""

    turn: int
    step: int
    system: int = 0
    user: int = 0
    reasoning: int = 0
    answer: int = 0
    tool_call: int = 0
    tool_result: int = 0
    markup: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}


@dataclass(frozen=True)
class ReasoningShare:
    rendering: str  # keep or drop
    requests: int
    last_view: float
    burden: float

    def as_dict(self) -> dict:
        return {"rendering": self.rendering, "requests": self.requests, "lastView": self.last_view,
                "burden": self.burden}


class _Splitter:
    """Splits an assistant span's ids into reasoning / answer / tool_call / markup,
    memoized (the same message recurs in every later prompt)."""

    def __init__(self, tpl: Template):
        self.tpl = tpl
        self._memo: dict[tuple[str, tuple[int, ...]], dict[str, int]] = {}

    def split(self, kind: str, ids: Sequence[int]) -> dict[str, int]:
        key = (kind, tuple(ids))
        if key not in self._memo:
            self._memo[key] = self._output(ids) if kind == "output" else self._answer(ids)
        return self._memo[key]

    def _output(self, ids: Sequence[int]) -> dict[str, int]:
        # A kept message as generated (think block, answer, calls in one span).
        parsed = self.tpl.parse_output(ids, "")
        out = self._answer(parsed.answer_ids)
        out["reasoning"] = len(parsed.reasoning_ids)
        out["markup"] = out.get("markup", 0) + len(ids) - len(parsed.reasoning_ids) - len(parsed.answer_ids)
        return out

    def _answer(self, ids: Sequence[int]) -> dict[str, int]:
        ids = list(ids)
        decode = self.tpl.tok.decode
        cut = decode(ids).find(self.tpl.call_marker) if self.tpl.call_marker else -1
        if cut < 0:
            return {"answer": len(ids)}
        # The first token whose text reaches the marker starts the call markup.
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(ids[: mid + 1])) > cut:
                hi = mid
            else:
                lo = mid + 1
        return {"answer": lo, "tool_call": len(ids) - lo}


def request_compositions(tpl: Template, system: Optional[str], tools: Sequence[dict],
                         messages: Sequence[Message], rendering: str) -> list[Composition]:
    """The prompt of every request (one per assistant message) under `rendering`
    (keep or drop), in order. Raises ValueError for another rendering."""
    if rendering not in RENDERINGS:
        raise ValueError(f"rendering must be one of {', '.join(RENDERINGS)}, got {rendering!r}")
    splitter = _Splitter(tpl)
    out: list[Composition] = []
    step = 0
    for i, msg in enumerate(messages):
        if msg.role == "user":
            step = 0
        if msg.role != "assistant":
            continue
        keep = turn_rules.keep_all if rendering == "keep" else turn_rules.keep_from(msg.turn)
        rendered = tpl.render(system, tools, messages[:i], keep, True)
        counts = dict.fromkeys(CATEGORIES, 0)
        for span in rendered.spans:
            ids = rendered.ids[span.start : span.end]
            if span.kind in ("answer", "output"):
                for category, n in splitter.split(span.kind, ids).items():
                    counts[category] += n
            else:
                counts[_KIND.get(span.kind, "markup")] += len(ids)
        assert sum(counts.values()) == len(rendered.ids), "spans must cover the prompt"
        out.append(Composition(msg.turn, step, **counts))
        step += 1
    return out


def reasoning_share(rendering: str, compositions: Sequence[Composition]) -> ReasoningShare:
    """lastView and burden (module docstring) of one rendering's requests."""
    if not compositions:
        return ReasoningShare(rendering, 0, 0.0, 0.0)
    last = compositions[-1]
    total = sum(c.total for c in compositions)
    return ReasoningShare(rendering, len(compositions), last.reasoning / last.total if last.total else 0.0,
                          sum(c.reasoning for c in compositions) / total if total else 0.0)
