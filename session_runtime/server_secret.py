"""The server's secret: signs the thinking it hands to Anthropic clients and
encrypts the reasoning it hands to Responses clients (`encrypted_content`), so
that what a client sends back can be checked as the server's own.

Generated at the first start and kept with the data (`secret.key` in
`--data-dir`, readable by its owner only); without a data folder it lives as
long as the process. Standard library only: HMAC-SHA256 for signatures, and for
encryption HMAC-SHA256 in counter mode as the key stream with an HMAC tag over
the nonce and the ciphertext (encrypt-then-MAC).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Optional

_KEY_BYTES = 32
_NONCE_BYTES = 16
_TAG_BYTES = 16


class ServerSecret:
    """Signs and encrypts under one key; derived sub-keys keep the uses apart."""

    def __init__(self, key: bytes):
        assert len(key) == _KEY_BYTES, "the secret is 32 bytes"
        self._sign = hmac.new(key, b"sign", hashlib.sha256).digest()
        self._stream = hmac.new(key, b"stream", hashlib.sha256).digest()
        self._mac = hmac.new(key, b"mac", hashlib.sha256).digest()

    @classmethod
    def load(cls, data_dir: Optional[str]) -> "ServerSecret":
        """The secret kept in `data_dir` (made there at the first start), or a
        new one for this process when there is no data folder."""
        if not data_dir:
            return cls(secrets.token_bytes(_KEY_BYTES))
        path = Path(data_dir) / "secret.key"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            key = path.read_bytes()
            if len(key) != _KEY_BYTES:
                raise ValueError(f"{path} is not a secret of this server ({len(key)} bytes, not {_KEY_BYTES})")
            return cls(key)
        key = secrets.token_bytes(_KEY_BYTES)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return cls(key)

    def sign(self, text: str) -> str:
        """A signature of `text` (URL-safe base64, no padding)."""
        return _b64(hmac.new(self._sign, text.encode("utf-8"), hashlib.sha256).digest())

    def verify(self, text: str, signature: object) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(text), signature)

    def encrypt(self, text: str) -> str:
        """`text` encrypted and authenticated (URL-safe base64)."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        body = _xor(text.encode("utf-8"), self._keystream(nonce, len(text.encode("utf-8"))))
        return _b64(nonce + body + self._tag(nonce, body))

    def decrypt(self, token: object) -> Optional[str]:
        """The text of a token `encrypt` made under this secret; None for any
        other (tampered, foreign, malformed)."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)) if isinstance(token, str) else b""
        except (ValueError, TypeError):
            return None
        if len(raw) < _NONCE_BYTES + _TAG_BYTES:
            return None
        nonce, body, tag = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(nonce, body)):
            return None
        try:
            return _xor(body, self._keystream(nonce, len(body))).decode("utf-8")
        except UnicodeDecodeError:
            return None

    def _keystream(self, nonce: bytes, n: int) -> bytes:
        blocks = (hmac.new(self._stream, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                  for i in range((n + 31) // 32))
        return b"".join(blocks)[:n]

    def _tag(self, nonce: bytes, body: bytes) -> bytes:
        return hmac.new(self._mac, nonce + body, hashlib.sha256).digest()[:_TAG_BYTES]


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
