"""Limits over real loopback HTTP: a body over --max-body-bytes gets 413 before
it is read (from Content-Length, unread; chunked, once the read passes the
limit) and changes nothing; --max-tokens-limit bounds max_tokens (422 on the
session API) and the default; the flags are checked at start.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from session_runtime.api.settings import ApiSettings
from session_runtime.cli import main
from session_runtime.config import RuntimeConfig

from tests.api.conftest import MAX_CONTEXT, create, error_of, openai_error_of, served, snapshot, step_ok

LIMIT = 2048
MAX_TOKENS = 8
TOO_LARGE = f"the request body is over this server's limit of {LIMIT} bytes (--max-body-bytes)"


@pytest.fixture(scope="module")
def limited():
    with served(ApiSettings(max_body_bytes=LIMIT), max_tokens_limit=MAX_TOKENS) as live, \
            httpx.Client(base_url=live.url, timeout=120) as client:
        yield live, client


def raw_request(port: int, head: str, body: bytes = b"") -> bytes:
    """Send a request's head (and maybe part of its body) and read the answer
    without sending the rest: a server that waited for the body would time out."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_declared_length_over_the_limit_is_413_unread(limited):
    live, client = limited
    cid = create(client, system="[limits] Untouched by refused bodies.")
    step_ok(client.post(f"/v1/conversations/{cid}/messages", json={"content": "Hi", "forced": {"content": "x"}}))
    before = snapshot(client, cid)
    for declared in (50_000_000, LIMIT + 1):
        head = (f"POST /v1/conversations/{cid}/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {declared}\r\n")
        answer = raw_request(live.port, head, b'{"content": "')  # the rest never comes
        status, _, rest = answer.partition(b"\r\n")
        assert status == b"HTTP/1.1 413 Request Entity Too Large", answer[:200]
        body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
        assert body == {"error": {"type": "request_too_large", "message": TOO_LARGE}}
    assert snapshot(client, cid) == before
    assert client.get("/health").status_code == 200


def test_a_body_at_the_limit_is_served_one_over_is_not(limited):
    _, client = limited
    cid = create(client, system="[limits] The boundary.")
    before = snapshot(client, cid)

    def body(size: int) -> bytes:
        head = json.dumps({"content": "", "forced": {"content": "x"}}).encode()
        return json.dumps({"content": "a" * (size - len(head)), "forced": {"content": "x"}}).encode()

    assert len(body(LIMIT)) == LIMIT
    over = client.post(f"/v1/conversations/{cid}/messages", content=body(LIMIT + 1),
                       headers={"content-type": "application/json"})
    assert error_of(over, 413, "request_too_large") == TOO_LARGE
    assert snapshot(client, cid) == before
    step_ok(client.post(f"/v1/conversations/{cid}/messages", content=body(LIMIT),
                        headers={"content-type": "application/json"}))


def test_a_chunked_body_is_cut_off_at_the_limit(limited):
    _, client = limited
    cid = create(client, system="[limits] Chunked bodies.")
    before = snapshot(client, cid)
    sent = []

    def chunks(total: int):
        data = json.dumps({"content": "b" * (total - 40), "forced": {"content": "y"}}).encode()
        for i in range(0, len(data), 512):
            sent.append(i)
            yield data[i:i + 512]

    r = client.post(f"/v1/conversations/{cid}/messages", content=chunks(LIMIT * 4),
                    headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert error_of(r, 413, "request_too_large") == TOO_LARGE
    assert snapshot(client, cid) == before
    small = client.post(f"/v1/conversations/{cid}/messages", content=chunks(LIMIT // 2),
                        headers={"content-type": "application/json"})
    assert step_ok(small)["content"] == "y"


def test_max_tokens_over_the_limit_is_refused(limited):
    live, client = limited
    assert live.runtime.max_tokens_limit == MAX_TOKENS
    cid = create(client, system="[limits] max_tokens.")
    before = snapshot(client, cid)
    message = error_of(client.post(f"/v1/conversations/{cid}/messages", json={"content": "Hi", "max_tokens": 9}),
                       422, "invalid_request")
    assert message == f"max_tokens 9 is over this server's limit of {MAX_TOKENS} (--max-tokens-limit)"
    assert snapshot(client, cid) == before
    # Without max_tokens a step generates at most the limit (64 otherwise); at the limit is fine.
    assert step_ok(client.post(f"/v1/conversations/{cid}/messages", json={"content": "Hi"}))["accounting"][
        "output_tokens"] == MAX_TOKENS
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS  # the rest of the context otherwise
    count = len(live.runtime.conversations)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9,
                                                  "conversation_id": "limits-new", "create": True})
    assert openai_error_of(r, 400, "invalid_request_error", None, "max_tokens") == message
    assert len(live.runtime.conversations) == count


def test_without_an_operator_limit_a_cap_is_clamped_to_what_remains():
    """No --max-tokens-limit: a request without a cap gets what remains of the
    context, and a cap above the context is clamped to what remains (the answer
    ends on length), as SGLang and vLLM budget it."""
    with served(max_context=64) as live, httpx.Client(base_url=live.url, timeout=120) as client:
        messages = [{"role": "user", "content": "Hi"}]
        for body in ({"messages": messages}, {"messages": messages, "max_tokens": 5000, "temperature": 0.5}):
            r = client.post("/v1/chat/completions", json=body)
            usage = r.json()["usage"]
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 64  # the whole context, as vLLM budgets it


def test_the_limit_defaults_to_the_context_and_never_passes_it(capsys):
    assert RuntimeConfig(max_context=MAX_CONTEXT).max_tokens_limit is None
    for bad in (0, MAX_CONTEXT + 1):
        with pytest.raises(ValueError, match=rf"max_tokens_limit must be between 1 and max_context \(512\), got {bad}"):
            RuntimeConfig(max_context=MAX_CONTEXT, max_tokens_limit=bad)
    for flags, message in ((["--max-tokens-limit", "50000"], "max_tokens_limit must be between 1 and max_context"),
                           (["--max-body-bytes", "0"], "max_body_bytes must be >= 1, got 0")):
        assert main(["serve", *flags]) == 2
        assert message in capsys.readouterr().err


def test_the_default_limit_is_the_context(rt):
    assert rt.max_tokens_limit == MAX_CONTEXT
    assert rt.max_tokens(None) == 64 and rt.max_tokens(None, default=256) == 256
