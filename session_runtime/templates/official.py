"""A model folder's own Jinja chat template, rendered as `transformers` renders
it, with the control tokens it writes told apart from client text.

`OfficialRenderer.render(messages, tools, generation_prompt)` returns the text
and the positions of the control tokens the template itself wrote: where client
text spells a control token, the same conversation is rendered a second time
with every such spelling replaced by same-length filler, and a control token
counts only where both renderings have it (where none does, every control token
in the text is the template's own). Tokenizing the text split at those positions
(client stretches with the plain tokenizer) gives the official token ids,
except that text can never forge a control token.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from session_runtime.bounded_cache import BytesLRU, IdentityMemo
from session_runtime.errors import InvalidRequest
from session_runtime.tokenizer import Tokenizer

_FILLER = "\ue000"  # a private-use character: not whitespace, not a token boundary rule


@dataclass(frozen=True)
class RenderedText:
    text: str
    controls: tuple[tuple[int, int], ...]  # (start, end) of each control token the template wrote

    def pieces(self, start: int = 0, end: Optional[int] = None) -> list[tuple[str, bool]]:
        """text[start:end] as (text, is_control) runs."""
        end = len(self.text) if end is None else end
        out, pos = [], start
        first = bisect.bisect_right(self.controls, start, key=lambda c: c[1])  # the first control ending after start
        for i in range(first, len(self.controls)):
            a, b = self.controls[i]
            if a >= end:
                break
            assert start <= a and b <= end, "a slice cuts through a control token"
            if a > pos:
                out.append((self.text[pos:a], False))
            out.append((self.text[a:b], True))
            pos = b
        if pos < end:
            out.append((self.text[pos:end], False))
        return out


def read_chat_template(folder: Path) -> Optional[str]:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or the `default` of a list of named ones)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def special_token_kwargs(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... from tokenizer_config.json, as transformers passes
    them to the template."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return {}
    out = {}
    for key, value in json.loads(config.read_text()).items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


def _defuse(value: Any, pattern: re.Pattern) -> Any:
    """`value` with every control-token spelling in its strings replaced by filler
    of the same length (keys and values, nested)."""
    if isinstance(value, str):
        return pattern.sub(lambda m: _FILLER * len(m.group()), value)
    if isinstance(value, dict):
        return {_defuse(k, pattern): _defuse(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_defuse(v, pattern) for v in value]
    return value


def _spells_control(pattern: re.Pattern, value: Any) -> bool:
    """Does any string in `value` (keys and values, nested) spell a control token,
    so that `_defuse` would change it?"""
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_spells_control(pattern, k) or _spells_control(pattern, v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_spells_control(pattern, v) for v in value)
    return False


class OfficialRenderer:
    """Renders OpenAI-style message dicts with the folder's template. Memoized:
    every step renders the same prefixes again."""

    def __init__(self, chat_template: str, tok: Tokenizer, kwargs: dict[str, str]):
        from transformers.utils.chat_template_utils import render_jinja_template

        self.chat_template = chat_template
        self.tok = tok
        # A template that writes today's date (gpt-oss's `strftime_now`) writes the day this
        # renderer was built, on every render: a conversation's prompt reads the same on every step, past
        # midnight too (its prefix, and the memo's renders, stay those of a fresh render).
        self.today = datetime.now()
        self.kwargs = {**kwargs, "strftime_now": self.strftime_now}
        self._render_jinja = render_jinja_template
        controls = sorted((t for t in tok.added if t), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, controls))) if controls else None
        # Every step renders the same prefixes again: memoized, within 128 MB.
        self._memo = BytesLRU(128 << 20, lambda key, r: 2 * len(r.text) + 64 * len(r.controls) + 200)

    def strftime_now(self, fmt: str) -> str:
        """The template's clock: the day this renderer was built, in `fmt`."""
        return self.today.strftime(fmt)

    def render(self, messages: Sequence[dict], tools: Sequence[dict], generation_prompt: bool,
               key: Optional[bytes] = None) -> RenderedText:
        """The template's rendering, memoized by a digest of the messages and
        tools (`key`: one the caller computed for them, as HFTemplate does for
        every prefix of a conversation in one pass, so that rendering its
        prefixes one by one does not serialize each again)."""
        if key is None:
            key = prefix_digests(list(messages), tools if isinstance(tools, list) else list(tools), [len(messages)])[0]
        return self._memo.get_or_compute((key, generation_prompt),
                                         lambda: self._render_key(messages, tools, generation_prompt))

    def text(self, messages: Sequence[dict], tools: Sequence[dict], generation_prompt: bool) -> str:
        return self.render(messages, tools, generation_prompt).text

    def plain_text(self, messages: Sequence[dict], tools: Sequence[dict]) -> str:
        """The rendering without the generation prompt, not memoized (a one-off)."""
        return self._jinja(list(messages), list(tools), False)

    def _jinja(self, messages: list, tools: list, generation_prompt: bool) -> str:
        try:
            return self._render_jinja([messages], tools=tools or None, chat_template=self.chat_template,
                                      add_generation_prompt=generation_prompt, **self.kwargs)[0][0]
        except Exception as exc:  # the template's raise_exception, or a shape it cannot render
            raise InvalidRequest(f"the model's chat template refused this conversation: {exc}") from exc

    def _render_key(self, messages: Sequence[dict], tools: Sequence[dict], generation_prompt: bool) -> RenderedText:
        # A copy in plain JSON types, key order kept (templates iterate dicts).
        messages, tools = json.loads(json.dumps([list(messages), list(tools)], ensure_ascii=False))
        text = self._jinja(messages, tools, generation_prompt)
        if self._pattern is None:
            return RenderedText(text, ())
        found = [(m.start(), m.end()) for m in self._pattern.finditer(text)]
        if not _spells_control(self._pattern, [messages, tools]):  # defusing would change nothing
            return RenderedText(text, tuple(found))
        defused = self._jinja(_defuse(messages, self._pattern), _defuse(tools, self._pattern), generation_prompt)
        if len(defused) != len(text):
            raise InvalidRequest("text that spells the model's control tokens changes how its chat template "
                                 "renders the conversation; remove them")
        ours = {(m.start(), m.end()) for m in self._pattern.finditer(defused)}
        return RenderedText(text, tuple(span for span in found if span in ours))

    def encode(self, rendered: RenderedText, start: int = 0, end: Optional[int] = None) -> list[int]:
        """Token ids of rendered.text[start:end]: control tokens where the template
        wrote them, every stretch between them tokenized whole as plain text."""
        ids: list[int] = []
        for text, control in rendered.pieces(start, end):
            ids += [self.tok.token_id(text)] if control else self.tok.encode_text(text)
        return ids

    def encode_with_starts(self, rendered: RenderedText, start: int = 0) -> tuple[list[int], list[int]]:
        """Ids of the text from `start` (a piece's start) and each token's start offset in it."""
        ids: list[int] = []
        starts: list[int] = []
        pos = start
        for text, control in rendered.pieces(start):
            if control:
                ids.append(self.tok.token_id(text))
                starts.append(pos)
            else:
                enc = self.tok.plain.encode(text, add_special_tokens=False)
                ids += enc.ids
                starts += [pos + a for a, _ in enc.offsets]
            pos += len(text)
        return ids, starts


def prefix_digests(messages: list[dict], tools: list[dict], at: Sequence[int], salt: object = None,
                   blobs: Optional[Sequence[bytes]] = None) -> list[bytes]:
    """A digest of (salt, tools, messages[:i]) for each i in `at` (ascending), in
    one pass. `blobs`: the messages' `blob`s where the caller keeps them."""
    h = hashlib.blake2b(_tools_bytes(tools) + json.dumps(salt).encode("utf-8", "surrogatepass"), digest_size=16)
    out, i = [], 0
    for end in at:
        while i < end:
            h.update(blobs[i] if blobs is not None else blob(messages[i]))
            i += 1
        out.append(h.copy().digest())
    return out


# tools list -> its bytes in a digest, per list object
_TOOLS: IdentityMemo[bytes] = IdentityMemo(16 << 20, lambda tools, out: len(out) + 100)


def _tools_bytes(tools: list) -> bytes:
    """A tools list's bytes in a digest, kept per list object (a conversation's
    renderings digest the same tools, tens of kilobytes for a coding agent's,
    many times a step)."""
    return _TOOLS.get(tools, lambda t: json.dumps(t, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\x1d")


def text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def blob(message: dict) -> bytes:
    """A message's bytes in a digest."""
    return json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\x1e"
