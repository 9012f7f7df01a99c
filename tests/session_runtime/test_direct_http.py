"""The step's HTTP client (`session_runtime/direct_http.py`) against a real
HTTP/1.1 server on loopback: kept-alive connections reused, never one the
server closed, chunked streams read line by line as they come, a read
unblocked from another thread, clear errors, and the environment's proxy."""

from __future__ import annotations

import http.client
import http.server
import io
import socket
import threading
import time

import pytest

from session_runtime.direct_http import DirectPool, TransportError, _headers, proxy_for


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        body = self.rfile.read(int(self.headers["content-length"]))
        server.seen.append((self.requestline, dict(self.headers), body, self.client_address))
        if self.path.endswith("/stream"):
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            # lines split across chunks, and a chunk with two lines
            for piece in (b"data: {\"a\"", b": 1}\n\ndata: {\"a\": 2}\n\nda", b"ta: [DONE]\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path.endswith("/hang"):
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            server.release.wait(10)
            return
        reply = b"echo:" + body
        self.send_response(200 if not self.path.endswith("/missing") else 404)
        self.send_header("content-length", str(len(reply)))
        if self.path.endswith("/close"):
            self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture(autouse=True)
def no_proxy_in_env(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.seen, srv.release = [], threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def _url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_posts_reuse_one_kept_alive_connection_and_carry_the_headers(server):
    pool = DirectPool(_url(server) + "/base/", headers={"Authorization": "Bearer k"})
    for k in range(3):
        with pool.post("/x", b"body%d" % k, {"content-type": "application/json"}) as resp:
            assert resp.status == 200 and resp.read() == b"echo:body%d" % k
    clients = {seen[3] for seen in server.seen}
    assert len(clients) == 1  # one connection, three requests
    line, headers, _, _ = server.seen[0]
    assert line == "POST /base/x HTTP/1.1"
    assert headers["Authorization"] == "Bearer k" and headers["content-type"] == "application/json"
    pool.close()


def test_a_request_is_one_write_of_its_head_and_body(server, monkeypatch):
    """One socket call per request (each releases the GIL), and the server reads it whole."""
    writes, real = [], socket.socket.sendall

    def sendall(sock, data, *args):
        if sock.getpeername()[1] == server.server_address[1]:  # the client's, not the server's answer
            writes.append(len(data))
        return real(sock, data, *args)
    monkeypatch.setattr(socket.socket, "sendall", sendall)
    pool = DirectPool(_url(server))
    body = b"x" * 70_000  # larger than a segment, a socket buffer
    with pool.post("/x", body, {"content-type": "application/json"}) as resp:
        assert resp.status == 200 and resp.read() == b"echo:" + body
    assert len(writes) == 1 and writes[0] > len(body)
    assert server.seen[-1][2] == body
    pool.close()


def test_a_connection_the_server_closed_is_never_used_again(server):
    pool = DirectPool(_url(server))
    with pool.post("/close", b"a") as resp:  # the server says it closes
        assert resp.read() == b"echo:a"
    with pool.post("/x", b"b") as resp:
        assert resp.read() == b"echo:b"
    # and one it closed while idle (its keep-alive ran out): found closed before use
    idle = pool._idle[0]
    idle.sock.shutdown(socket.SHUT_RDWR)  # what a server's close looks like from here
    with pool.post("/x", b"c") as resp:
        assert resp.read() == b"echo:c"
    assert idle.sock is None  # discarded, not sent on
    assert len({seen[3] for seen in server.seen}) == 3
    pool.close()


def test_a_chunked_stream_comes_out_line_by_line(server):
    pool = DirectPool(_url(server))
    with pool.post("/stream", b"{}") as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines == [b'data: {"a": 1}', b'data: {"a": 2}', b"data: [DONE]"]
    with pool.post("/x", b"again") as resp:  # read to its end: the connection goes back to the pool
        assert resp.read() == b"echo:again"
    assert len({seen[3] for seen in server.seen}) == 1
    pool.close()


def test_hang_up_from_another_thread_ends_a_blocked_read(server):
    pool = DirectPool(_url(server))
    t0 = time.monotonic()
    with pool.post("/hang", b"{}") as resp:
        threading.Timer(0.3, resp.hang_up).start()
        with pytest.raises(TransportError):
            for _ in resp.iter_lines():
                pass
    assert time.monotonic() - t0 < 5
    assert pool._idle == []  # a broken connection is not kept
    pool.close()


def test_errors_name_the_server_and_4xx_is_an_answer(server):
    with DirectPool(_url(server)).post("/missing", b"q") as resp:
        assert resp.status == 404
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}/generate"):
        with DirectPool(f"http://127.0.0.1:{port}").post("/generate", b"{}"):
            pass
    with pytest.raises(ValueError):
        DirectPool("unix:///tmp/x")


def test_the_environments_proxy_is_used_as_httpx_would(server, monkeypatch):
    proxy = f"http://user:p%40ss@127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.setenv("NO_PROXY", "bypassed.example")
    assert proxy_for("http://sglang.internal:30000") == proxy
    assert proxy_for("http://bypassed.example:30000") is None
    # the "proxy" is our echo server: it sees the absolute URL and the proxy's credentials
    with DirectPool("http://sglang.internal:30000").post("/generate", b"p") as resp:
        assert resp.read() == b"echo:p"
    line, headers, _, _ = server.seen[-1]
    assert line == "POST http://sglang.internal:30000/generate HTTP/1.1"
    assert headers["Proxy-Authorization"] == "Basic dXNlcjpwQHNz"  # user:p@ss


@pytest.mark.parametrize("block", [
    b"content-type: application/json\r\ncontent-length: 456\r\n\r\n",
    b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Empty:\r\nX-Spaces:    padded   \r\nA:b:c\r\n\r\n",
    b"Transfer-Encoding: chunked\nConnection: close\n\n",
    b"\r\n",
])
def test_headers_are_read_as_the_standard_library_reads_them(block):
    """The pool's header reader (without `email`'s parser) against http.client.parse_headers."""
    ours, theirs = _headers(io.BytesIO(block)), http.client.parse_headers(io.BytesIO(block))
    assert ours.items() == theirs.items()
    assert ours.get_all("set-cookie") == theirs.get_all("set-cookie")


def test_a_folded_header_is_joined_and_a_bad_line_skipped():
    ours = _headers(io.BytesIO(b"X-Folded: first\r\n  second\r\n\tthird\r\nnot a header\r\nOther: y\r\n\r\n"))
    assert ours.items() == [("X-Folded", "first second third"), ("Other", "y")]
    with pytest.raises(http.client.HTTPException):  # the standard library's bound on their count
        _headers(io.BytesIO(b"".join(b"H%d: v\r\n" % i for i in range(200)) + b"\r\n"))
