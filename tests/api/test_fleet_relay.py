"""A relayed request whose owner fails (api/forward.py): where the owner never
got it (nothing listens), the answer is 503, retry later, nothing changed,
and the owner is struck off the members at once;
where it got it and stopped answering (killed mid-step, maybe after storing
the step), 502 `owner_lost`, since "nothing changed" may be false. Real
sockets on loopback; the relaying process's fleet is a two-field stand-in."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from types import SimpleNamespace

from session_runtime.api.forward import Forward
from session_runtime.store.fleet import Route


STRUCK: list[str] = []  # members the relaying process struck off as gone (Fleet.unreachable)


def _relay(url: str) -> tuple[int, dict]:
    fwd = Forward(lambda *a: None, SimpleNamespace(fleet=SimpleNamespace(id="b", ttl=2.0, unreachable=STRUCK.append)))
    scope = {"type": "http", "method": "POST", "path": "/v1/conversations/c1/messages",
             "raw_path": b"/v1/conversations/c1/messages", "query_string": b"", "headers": []}
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        await fwd._relay(scope, b'{"content": "hi"}', Route("a", url), send)
        await fwd.client.aclose()

    asyncio.run(run())
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_an_owner_that_cannot_be_reached_is_503():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    STRUCK.clear()
    status, body = _relay(f"http://127.0.0.1:{port}")
    assert status == 503 and body["error"]["type"] == "unavailable"
    assert STRUCK == ["a"]  # refused: it is gone, taken over at the next request


def test_an_owner_that_dies_with_the_request_is_502_owner_lost():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def accept_and_die() -> None:
        conn, _ = server.accept()
        conn.recv(65536)  # it has the request...
        conn.close()  # ...and dies before answering

    STRUCK.clear()
    t = threading.Thread(target=accept_and_die)
    t.start()
    try:
        status, body = _relay(f"http://127.0.0.1:{server.getsockname()[1]}")
    finally:
        t.join(10)
        server.close()
    assert status == 502 and body["error"]["type"] == "owner_lost"
    assert "may have been stored" in body["error"]["message"]
    assert "a" not in STRUCK  # it had the request: its beat's TTL decides
