"""A step's reasoning and content deltas as its tokens arrive, in constant work
per token.

The template's `parse_output` says what the whole output is (reasoning, answer
text, tool calls). Parsing the whole output again at every token costs time
in proportion to its length, so a long stream cost the square of it (a
32k-token reasoning: minutes of CPU on the streaming thread). Here the
output is parsed whole only while it is short and at each added token
(`</think>`, `<tool_call>`, a stop token: where a field can start or end); in
between, a plain token can only extend the field being written, so its text is
decoded on its own (a few tokens of context, as vLLM detokenizes) and appended.

What is sent is never taken back: text that may still become tool-call markup
or one of the request's stop sequences (whose text the client never sees),
an incomplete character and trailing newlines (which the templates strip at a
field's end) wait for what follows, or for the whole step.
"""

from __future__ import annotations

from typing import Optional, Sequence

from session_runtime.templates.base import Template

FIELDS = ("reasoning", "content")
_EXACT_BELOW = 128  # tokens: a short output is parsed whole at every token


class OutputDeltas:
    def __init__(self, tpl: Template, stop: Sequence[str] = ()):
        self.tpl = tpl
        self._markers = {"reasoning": tuple(stop), "content": (tpl.call_marker, *stop) if tpl.call_marker else tuple(stop)}
        self._added = tpl.tok.added_ids
        self.ids: list[int] = []
        self.sent = {f: [] for f in FIELDS}  # chunks sent, per field
        self._fast: Optional[_Field] = None  # the field plain tokens extend, once known
        self._follow_at = _EXACT_BELOW  # output length from which to try following a field again

    def push(self, token: int) -> list[tuple[str, str]]:
        """The deltas `token` adds, as (field, text)."""
        self.ids.append(token)
        if self._fast is not None and token not in self._added:
            return self._emit(self._fast.field, self._fast.push(token))
        self._fast = None
        return self._exact()

    def finish(self, reasoning: str, content: str) -> list[tuple[str, str]]:
        """What the whole step adds to what was sent (held-back text, its last newlines)."""
        out = []
        for field, text in zip(FIELDS, (reasoning, content)):
            sent = self._text(field)
            if len(text) > len(sent) and text.startswith(sent):
                out.append((field, text[len(sent):]))
        return out

    # ----- the whole output parsed --------------------------------------------------

    def _exact(self) -> list[tuple[str, str]]:
        parsed = self.tpl.parse_output(self.ids, "")
        out = []
        for field, text in (("reasoning", parsed.reasoning), ("content", parsed.content)):
            text = safe_prefix(text, self._markers[field]).rstrip("\n")  # a field's last newlines wait: the templates strip them
            sent = self._text(field)
            if len(text) > len(sent) and text.startswith(sent):
                out += self._emit(field, text[len(sent):])
        if len(self.ids) >= self._follow_at and self.ids[-1] not in self._added:
            self._fast = self._follow(parsed)
        return out

    def _follow(self, parsed) -> Optional[_Field]:
        """The field a plain token would extend, where its parsed text is its
        decoded ids from some offset on (less trailing newlines) and what was
        sent is a prefix of that; None where the template does more (then the
        next token is parsed whole too)."""
        field, ids, text = ("content", parsed.answer_ids, parsed.content) if parsed.answer_ids \
            else ("reasoning", parsed.reasoning_ids, parsed.reasoning)
        raw = self.tpl.tok.decode(ids)
        body = text.rstrip("\n")
        start = len(raw.rstrip("\n")) - len(body)
        sent, markers = self._text(field), self._markers[field]
        if not body or raw.endswith("\ufffd"):
            return None  # nothing to anchor on yet: the next token is parsed whole
        if start < 0 or raw[start:start + len(body)] != body or not raw.startswith(sent, start):
            # The template does more than strip here: parsed whole, tried again a quarter further on.
            self._follow_at = len(self.ids) + len(self.ids) // 4
            return None
        if any(m in raw[start:] for m in markers):  # tool-call markup or a stop: the rest comes with the step
            return _Field(field, self.tpl.tok, ids, "", frozen=True)
        return _Field(field, self.tpl.tok, ids, raw[start + len(sent):], markers=markers)

    # ----- bookkeeping --------------------------------------------------------------

    def _text(self, field: str) -> str:
        chunks = self.sent[field]
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
        return chunks[0] if chunks else ""

    def _emit(self, field: str, text: str) -> list[tuple[str, str]]:
        if not text:
            return []
        self.sent[field].append(text)
        return [(field, text)]


class _Field:
    """One field's text past what was sent, extended token by token."""

    def __init__(self, field: str, tok, ids: list[int], unsent: str, markers: tuple[str, ...] = (),
                 frozen: bool = False):
        self.field = field
        self.tok = tok
        self.markers = markers
        self.frozen = frozen
        self.unsent = unsent
        self.window = list(ids[-6:])  # decoding context: a character or a word split across tokens
        self.read = len(self.window)

    def push(self, token: int) -> str:
        """The text that can be sent now."""
        if self.frozen:
            return ""
        self.window.append(token)
        before = self.tok.decode(self.window[: self.read])
        now = self.tok.decode(self.window)
        if now.endswith("\ufffd"):
            return ""  # the rest of a character is still to come
        self.unsent += now[len(before):]
        self.window = self.window[-6:]
        self.read = len(self.window)
        text = safe_prefix(self.unsent, self.markers)
        if any(m in self.unsent for m in self.markers):
            self.frozen = True  # tool-call markup or a stop: the rest comes with the step
        text = text.rstrip("\n")
        self.unsent = self.unsent[len(text):]
        return text


def safe_prefix(text: str, markers: Sequence[str]) -> str:
    """The part of partly decoded text that can be sent and never taken back:
    without a trailing incomplete character (decoded as U+FFFD until its last
    byte arrives) and without anything that is, or may become, one of
    `markers` (the start of tool-call markup, which is not content; a stop
    sequence, which the client never sees)."""
    text = text.rstrip("\ufffd")
    cuts = [at for at in (text.find(m) for m in markers if m) if at >= 0]
    if cuts:
        text = text[:min(cuts)]
    held = max((keep for m in markers if m for keep in range(min(len(m) - 1, len(text)), 0, -1)
                if m.startswith(text[-keep:])), default=0)
    return text[:len(text) - held]
