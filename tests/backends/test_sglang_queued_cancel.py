"""A step that waits in the server's queue (no chunk comes) still stops at its
deadline, or when it is cancelled (a client that left, shutdown): the stream
is closed at once, so SGLang aborts the request, and the step fails with the
cancellation's error. A /generate on loopback that accepts the request and
then sends nothing stands for SGLang's queue (its real queue is tested
waiting in test_sglang_pressure.py); found when a step queued behind held
chains ran past a 120 s deadline to the 600 s one."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from radix_ext.tree import Namespace
from session_runtime.backends.base import Cancellation, StepRequest
from session_runtime.errors import DeadlineExceeded, ShuttingDown


@pytest.fixture
def silent_server():
    """Accepts POST /generate, answers 200 with a stream, sends nothing; records when the client hung up."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    closed: list[float] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            conn.settimeout(30)
            try:
                while conn.recv(4096):  # b"" when the client closes
                    pass
            except OSError:
                pass
            closed.append(time.monotonic())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", closed
    sock.close()


def _backend(url: str):
    from session_runtime.backends.sglang.backend import SGLangBackend

    return SGLangBackend(url, None, page_size=16, capacity=2048, bytes_per_token=4096, vocab_size=1000,
                         max_context=4096, http=httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)))


def _request(cancel: Cancellation) -> StepRequest:
    return StepRequest(owner="c", prompt=[1, 2, 3], namespace=Namespace("m", None), cancel=cancel)


def test_a_queued_step_stops_at_its_deadline_and_closes_the_request(silent_server):
    url, closed = silent_server
    backend = _backend(url)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        backend.step(_request(Cancellation(deadline_s=1.0)))
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert closed and closed[0] - t0 < 10  # the server saw the request go: SGLang aborts it


def test_a_queued_step_stops_when_it_is_cancelled(silent_server):
    url, _ = silent_server
    backend = _backend(url)
    cancel = Cancellation()
    threading.Timer(0.5, lambda: cancel.cancel(ShuttingDown("the server is shutting down"))).start()
    t0 = time.monotonic()
    with pytest.raises(ShuttingDown):
        backend.step(_request(cancel))
    assert time.monotonic() - t0 < 10
