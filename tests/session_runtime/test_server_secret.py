"""The server's secret: signatures and encryption round-trip under it, and
anything tampered or made under another secret is refused."""

from __future__ import annotations

import os

import pytest

from session_runtime.server_secret import ServerSecret


def test_signatures_verify_only_under_the_same_secret_and_text(tmp_path):
    s = ServerSecret.load(str(tmp_path))
    sig = s.sign("I think, therefore.")
    assert s.verify("I think, therefore.", sig)
    assert not s.verify("I think, therefore!", sig)
    assert not s.verify("I think, therefore.", sig[:-1] + ("A" if sig[-1] != "A" else "B"))
    assert not s.verify("I think, therefore.", None)
    assert not ServerSecret.load(None).verify("I think, therefore.", sig)
    again = ServerSecret.load(str(tmp_path))  # kept with the data: the same after a restart
    assert again.verify("I think, therefore.", sig)
    assert oct(os.stat(tmp_path / "secret.key").st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("text", ["", "short", "思考 " * 500])
def test_encryption_round_trips_and_refuses_tampering(tmp_path, text):
    s = ServerSecret.load(str(tmp_path))
    token = s.encrypt(text)
    assert s.decrypt(token) == text and (not text or text.encode() not in token.encode())
    assert s.encrypt(text) != token  # a fresh nonce each time
    flipped = token[:30] + ("A" if token[30] != "A" else "B") + token[31:]
    assert s.decrypt(flipped) is None
    assert ServerSecret.load(None).decrypt(token) is None
    assert s.decrypt("not base64 !!") is None and s.decrypt(12) is None and s.decrypt("") is None


def test_a_foreign_key_file_is_refused(tmp_path):
    (tmp_path / "secret.key").write_bytes(b"short")
    with pytest.raises(ValueError, match="is not a secret of this server"):
        ServerSecret.load(str(tmp_path))
