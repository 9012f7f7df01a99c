"""Template `hf`: any model folder's own Jinja chat template (official.py renders
it), fitted to the runtime's rendering contract.

The prompt is built from official renderings of prefixes of the conversation:

- The head, everything up to and including the first user message of the first
  turn that keeps its reasoning, is the template's own rendering of that prefix:
  earlier turns appear as the template writes history, so the fork sits where
  the template itself drops reasoning (Qwen3 and GLM-4.5 drop a closed turn's
  reasoning, gpt-oss its analysis channel).
- After it, each message is the text the template adds for it (the difference
  between the renderings with and without it), except that an assistant message
  of a kept turn replays the ids it was generated as, between the template's
  generation prompt and the end the template writes after it.
- With no kept turn (the canonical history once a turn closes), the rendering is
  the template's text before a next user message.

Typed spans come from the same prefixes: each message's span covers the tokens
that start inside its text.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Optional, Sequence

from session_runtime.bounded_cache import BytesLRU
from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import KeepReasoning, Message, ParsedOutput, Rendered, ToolCall, message_groups
from session_runtime.templates.hf_messages import TemplateMessages
from session_runtime.templates.hf_parse import parser_for
from session_runtime.templates.hf_windows import SENTINEL as _SENTINEL, WindowedRender, WindowMismatch, windows_hold
from session_runtime.templates.official import (OfficialRenderer, RenderedText, prefix_digests,
                                               read_chat_template, special_token_kwargs, text_digest as _digest)
from session_runtime.tokenizer import Tokenizer

_KIND = {"user": "user", "assistant": "answer", "tool": "tool_result", "system": "system"}


@dataclasses.dataclass(frozen=True)
class _PrefixCheck:
    """The rendering of the messages before a group of a head: its length and
    digest, and whether it was a prefix of that head's text."""

    length: int
    text_digest: bytes
    fits: bool


@dataclasses.dataclass(frozen=True)
class _HeadChecks:
    cut: int
    text_digest: bytes  # of the head's text up to `cut`
    groups: tuple[Optional[_PrefixCheck], ...]  # None: the template could not render the prefix alone


class HFTemplate:
    name = "hf"

    def __init__(self, tok: Tokenizer, folder: Path):
        chat_template = read_chat_template(folder)
        if chat_template is None:
            raise InvalidRequest(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json)")
        self.tok = tok
        self.official = OfficialRenderer(chat_template, tok, special_token_kwargs(folder))
        self._thinking_field = "thinking" if "thinking" in chat_template and "reasoning_content" not in chat_template \
            else "reasoning_content"
        self._stops = self._stop_ids(folder)
        self._stop_texts = sorted({tok.decode([i]) for i in self._stops}, key=len, reverse=True)
        self.parser = parser_for(chat_template)
        self.call_marker = self.parser.call_marker
        self._user_header = self._find_user_header()
        self._think = tok.inner.token_to_id("<think>")  # None: the tokenizer has no reasoning block
        self.opens_thinking = self._opens_thinking()
        self._checks = BytesLRU(16 << 20, lambda key, v: 100 + 80 * len(v.groups))  # _marks
        heads = BytesLRU(64 << 20, lambda key, spans: 2 * len(key) + sum(8 * len(ids) + 100 for _, ids in spans))
        self._heads = lambda key: heads.get_or_compute(key, lambda: self._head_spans(key))
        self.messages = TemplateMessages(self._thinking_field)  # the messages as the template takes them
        self.windowed: Optional[WindowedRender] = WindowedRender(self)  # None: rendered whole
        if not windows_hold(self):
            self.windowed = None

    # ----- the folder -------------------------------------------------------------

    def _stop_ids(self, folder: Path) -> frozenset[int]:
        """generation_config.json's eos_token_id (one or a list), and the
        tokenizer's eos_token."""
        ids: set[int] = set()
        gen = folder / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
        eos = self.official.kwargs.get("eos_token")
        if eos and self.tok.inner.token_to_id(eos) is not None:
            ids.add(self.tok.token_id(eos))
        if not ids:
            raise InvalidRequest(f"{folder}: no eos_token_id in generation_config.json and no eos_token")
        return frozenset(ids)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stops

    def _find_user_header(self) -> str:
        """The text the template writes before a user message's content that
        follows another user message (after the first one's end)."""
        one = self.official.text([{"role": "user", "content": "\ue003"}], [], False)
        two = self.official.text([{"role": "user", "content": "\ue003"}, {"role": "user", "content": _SENTINEL}], [], False)
        first_end = one[one.index("\ue003") + 1:]
        between = two[two.index("\ue003") + 1: two.index(_SENTINEL)]
        if not between.startswith(first_end):
            raise InvalidRequest("the chat template renders a user message differently when another follows it")
        return between[len(first_end):]

    def _opens_thinking(self) -> bool:
        """Does the generation prompt open the reasoning block itself (Qwen3's
        thinking models, DeepSeek-R1: `<think>\\n` after the assistant's header)?
        Then the model's output starts inside it, with no `<think>` of its own."""
        if self.parser.family == "harmony" or self.tok.inner.token_to_id("</think>") is None:
            return False
        prompt = self.official.text([{"role": "user", "content": "\ue003"}], [], True)
        return prompt.rstrip().endswith("<think>")

    # ----- rendering ----------------------------------------------------------------

    def rendered_length(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
                        keep: KeepReasoning, generation_prompt: bool = True) -> int:
        return len(self.render(system, tools, messages, keep, generation_prompt).ids)

    def render(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
               keep: KeepReasoning, generation_prompt: bool = True) -> Rendered:
        tools = self.messages.tools(tools)
        dicts = self.messages.dicts(system, messages)
        offset = len(dicts) - len(messages)  # the system message
        groups = list(message_groups(messages))
        ends, pos = [], 0
        for _, group in groups:
            pos += len(group)
            ends.append(pos)
        first_kept = next((g for g, (role, group) in enumerate(groups) if role == "user" and keep(group[0].turn)), None)
        out = Rendered()
        if not messages:  # the system part alone, where the template writes it before any user message
            try:
                self._head(out, dicts, tools, offset, groups, ends, closed=True)
            except InvalidRequest:  # it does not (Llama 3 puts the tools into the first user message)
                pass
            return out
        if self.windowed is not None and messages[0].role == "user":
            try:
                self.windowed.render(out, dicts, tools, offset, messages, groups, ends, first_kept, keep,
                                     generation_prompt)
                return out
            except WindowMismatch:
                out = Rendered()
        if first_kept is None:
            self._head(out, dicts, tools, offset, groups, ends, closed=True)
            start = len(groups)
        else:
            self._head(out, dicts[: offset + ends[first_kept]], tools, offset, groups[: first_kept + 1],
                       ends[: first_kept + 1], closed=False)
            start = first_kept + 1
        carry = None  # a stop token the model ended with that the next message's text opens with (GLM)

        def add(kind: str, ids: list[int]) -> None:
            out.add(kind, ids[1:] if carry is not None and ids[:1] == [carry] else ids)

        # The memo keys of every prefix, in one pass over the messages.
        keys = prefix_digests(dicts, tools, range(len(dicts) + 1)) if start < len(groups) else []
        for g in range(start, len(groups)):
            role, group = groups[g]
            a, b = offset + ends[g] - len(group), offset + ends[g]
            if role == "assistant" and group[0].output_ids and keep(group[0].turn):
                before = self.official.render(dicts[:a], tools, False, keys[a])
                prompt = self.official.render(dicts[:a], tools, True, keys[a])
                assert prompt.text.startswith(before.text), "generation prompt is not an append"
                add("generation_prompt", self.official.encode(prompt, len(before.text)))
                after = self.official.render(dicts[:b], tools, False, keys[b])
                ids, carry, end = self._generated(group[0].output_ids, after)
                out.add("output", ids)
                out.add("eos", end)
                continue
            add(_KIND[role], self._appended(dicts[:a], dicts[:b], tools, _KIND[role], keys[a], keys[b]))
            carry = None
        if generation_prompt and messages and messages[-1].role != "assistant":
            prompt = self.official.render(dicts, tools, True)
            base = self.official.text(dicts, tools, False)
            assert prompt.text.startswith(base), "generation prompt is not an append"
            add("generation_prompt", self.official.encode(prompt, len(base)))
        return out

    def _head(self, out: Rendered, dicts: list[dict], tools: list[dict], offset: int, groups, ends, closed: bool) -> None:
        """The template's own rendering of `dicts` (closed: as history before a next
        user message), memoized: it changes only when a turn opens or closes."""
        kinds = [_KIND[role] for role, _ in groups]
        key = json.dumps([dicts, tools, offset, kinds, [len(g) for _, g in groups], closed], ensure_ascii=False)
        for kind, ids in self._heads(key):
            out.add(kind, list(ids))

    def _head_spans(self, key: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Spans start where a prefix's rendering is a prefix of the head; a message
        whose start moves with what follows joins the span before."""
        dicts, tools, offset, kinds, sizes, closed, *skip = json.loads(key)
        if closed:
            text = self.official.render([*dicts, {"role": "user", "content": _SENTINEL}], tools, False)
            cut = text.text.index(_SENTINEL) - len(self._user_header)
            if text.text[cut: cut + len(self._user_header)] != self._user_header:
                raise InvalidRequest("the chat template writes a user message here unlike elsewhere")
        else:
            text = self.official.render(dicts, tools, False)
            cut = len(text.text)
        rendered = RenderedText(text.text[:cut], tuple(c for c in text.controls if c[1] <= cut))
        start = 0
        if skip:  # a window (hf_windows.py): its system part, this long and of this digest, is left out
            start, digest = skip[0]
            if _digest(rendered.text[:start]).hex() != digest or (
                    start < cut and not any(a == start for a, _ in rendered.controls)):
                raise WindowMismatch("a window's rendering does not open with the system part")
        ids, starts = self.official.encode_with_starts(rendered, start)
        marks = self._marks(dicts, tools, offset, kinds, sizes, text.text, cut)
        spans, k = [], 0
        for i, (_, kind) in enumerate(marks):
            stop = marks[i + 1][0] if i + 1 < len(marks) else cut
            j = k
            while j < len(ids) and starts[j] < stop:
                j += 1
            spans.append((kind, tuple(ids[k:j])))
            k = j
        return tuple(spans)

    def _marks(self, dicts: list[dict], tools: list[dict], offset: int, kinds: list[str], sizes: list[int],
               text: str, cut: int) -> list[tuple[int, str]]:
        """Where each group's text starts in the head `text` (up to `cut`): the
        length of the rendering of the messages before it, where that rendering
        is a prefix of the head. The checks of an earlier head that this one
        extends (its messages and then more, its text up to its cut the same)
        are kept: only the prefixes of the groups after it are rendered, so a
        turn costs the renderings of its own messages, not of every earlier one."""
        starts = [offset + n for n in itertools.accumulate([0, *sizes[:-1]])] if sizes else []
        digests = prefix_digests(dicts, tools, [*starts, len(dicts)], salt=offset)
        checks: list[Optional[_PrefixCheck]] = []
        for g in range(len(starts), 0, -1):  # the longest earlier head with these messages first
            earlier = self._checks.get(digests[g])
            if earlier is not None and earlier.cut <= cut and earlier.text_digest == _digest(text[:earlier.cut]):
                checks = [c if c is None or c.length <= earlier.cut
                          else dataclasses.replace(c, fits=c.text_digest == _digest(text[:c.length]))
                          for c in earlier.groups[:g]]
                break
        for g in range(len(checks), len(starts)):
            try:
                prefix = self.official.plain_text(dicts[: starts[g]], tools) if starts[g] else ""
            except InvalidRequest:  # a prefix the template cannot render alone (Llama 3's tools need a user)
                checks.append(None)
                continue
            checks.append(_PrefixCheck(len(prefix), _digest(prefix), text.startswith(prefix)))
        self._checks.put(digests[len(starts)], _HeadChecks(cut, _digest(text[:cut]), tuple(checks)))
        marks = [(0, "system")]
        for g, (kind, check) in enumerate(zip(kinds, checks)):
            if g == 0 and offset == 0:
                marks = [(0, kind)]
            elif check is not None and check.fits and marks[-1][0] < check.length <= cut:
                marks.append((check.length, kind))
        return marks

    def _appended(self, before: list[dict], after: list[dict], tools: list[dict], kind: str,
                  before_key: bytes, after_key: bytes) -> list[int]:
        """Ids of the text the template adds for the messages between `before` and `after` (their memo keys)."""
        a, b = self.official.render(before, tools, False, before_key), self.official.render(after, tools, False, after_key)
        if b.text.startswith(a.text):
            return self.official.encode(b, len(a.text))
        # The template renders what came before differently once more follows (an
        # assistant it rendered as the last message): the new text starts at the
        # user header, or after the end it writes for that assistant message.
        if kind == "user":
            with_sentinel = self.official.render([*before, {"role": "user", "content": _SENTINEL}], tools, False,
                                                 _digest(before_key.hex() + _SENTINEL)).text
            start = with_sentinel.index(_SENTINEL) - len(self._user_header)
        else:
            lcp = next((i for i, (x, y) in enumerate(zip(a.text, b.text)) if x != y), min(len(a.text), len(b.text)))
            start = self._after_end(b, lcp)
        return self.official.encode(b, start)

    def _after_end(self, rendered: RenderedText, pos: int) -> int:
        """The position after the first end-of-message control token at or after `pos`."""
        for a, b in rendered.controls:
            if a >= pos and rendered.text[a:b] in self._stop_texts:
                return b + len(self._tail_text(rendered.text[b:]))
        raise InvalidRequest("the chat template's rendering of this conversation has no end of message to cut at")

    @staticmethod
    def _tail_text(rest: str) -> str:
        """Whitespace the template writes after an end-of-message token ("\\n" in ChatML)."""
        return rest[: len(rest) - len(rest.lstrip("\n"))]

    def _generated(self, output_ids: Sequence[int], rendered: RenderedText) -> tuple[list[int], Optional[int], list[int]]:
        """A kept assistant message's ids as generated, the carry and the end ids.
        The stop token it ended with is kept as the carry when the template writes
        no end of its own for the message (GLM: the model stops at the next header,
        `<|observation|>` or `<|user|>`, which opens the next message); else the
        stop token goes and the template's end follows."""
        ids, end = list(output_ids), self._end_ids(rendered)
        if not ids or ids[-1] not in self._stops:
            return ids, None, end
        if end:
            return ids[:-1], None, end
        return ids, ids[-1], []

    def _end_ids(self, rendered: RenderedText) -> list[int]:
        """The end the template writes after the last message: from its last
        end-of-message control token on, or nothing (GLM ends a message with none)."""
        last = next(((a, b) for a, b in reversed(rendered.controls) if rendered.text[a:b] in self._stop_texts), None)
        if last is None or rendered.text[last[1]:].strip("\n"):
            return []
        return self.official.encode(rendered, last[0])

    # ----- outputs ------------------------------------------------------------------

    def forced_ids(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall] = ()) -> list[int]:
        """An assistant output given as text: what the template writes for it as
        the last message of an open turn (after the generation prompt)."""
        user = {"role": "user", "content": "\ue003"}
        msg = self.messages.dicts(None, [Message("assistant", 0, content=content, reasoning=reasoning,
                                         tool_calls=tuple(tool_calls))])
        prompt = self.official.render([user], [], True)
        full = self.official.render([user, *msg], [], False)
        if not full.text.startswith(prompt.text):
            raise InvalidRequest("the chat template writes an assistant message unlike its generation prompt")
        ends = [(a, b) for a, b in full.controls if full.text[a:b] in self._stop_texts and a >= len(prompt.text)]
        end = ends[-1][1] if ends else len(full.text)
        ids = self.official.encode(full, len(prompt.text), end)
        if not ends:  # the model ends such a message with the stop token that opens the next one (GLM)
            ids.append(self._next_stop(user, msg[0], full))
        return ids

    def _next_stop(self, user: dict, msg: dict, full: RenderedText) -> int:
        """The stop token the template writes first after `msg`: the tool results'
        header after calls, the next user's header after an answer."""
        after = ([{"role": "tool", "tool_call_id": c["id"], "content": "\ue003"} for c in msg["tool_calls"]]
                 if msg.get("tool_calls") else [{"role": "user", "content": "\ue003"}])
        nxt = self.official.render([user, msg, *after], [], False)
        for a, b in nxt.controls:
            if a >= len(full.text) and self.tok.token_id(nxt.text[a:b]) in self._stops:
                return self.tok.token_id(nxt.text[a:b])
        return min(self._stops)

    def strip_reasoning(self, msg: Message) -> Message:
        return dataclasses.replace(msg, reasoning="")

    def _thinking(self, ids: Sequence[int]) -> bool:
        """Is an output without `</think>` all reasoning: the prompt opened the
        block, or the output opened it (`<think>` after nothing but whitespace:
        GLM-4.5 writes "\n<think>")?"""
        if self.opens_thinking:
            return True
        head = list(ids[:4])
        if self._think is None or self.parser.family == "harmony" or self._think not in head:
            return False
        return not self.tok.decode(head[: head.index(self._think)]).strip()

    def parse_output(self, ids: Sequence[int], call_id_base: str) -> ParsedOutput:
        ids = list(ids)
        ended = bool(ids) and ids[-1] in self._stops
        if ended:
            ids = ids[:-1]
        reasoning, cut = self.parser.split(ids, self.tok)
        if cut == 0 and self._thinking(ids):  # still thinking when the output stopped (or so far, streaming)
            reasoning, cut = self.tok.decode(ids).replace("<think>", "", 1).strip("\n"), len(ids)
        content, calls = self.parser.calls(self.tok.decode(ids[cut:]), call_id_base)
        return ParsedOutput(ids[:cut], ids[cut:], content, calls, ended, reasoning)
