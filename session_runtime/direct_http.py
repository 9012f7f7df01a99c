"""POSTs to one server over kept-alive standard-library connections: the
HTTP of a step's own request to SGLang.

A step's `/generate` is the only call on its path, and every step's client
work runs under the runtime's one GIL: with 8 agents, what one step spends in
its HTTP client the others wait for, and the scheduler sees their requests
later and batches fewer of them. httpx spends ~0.9 ms of GIL time on one
streamed request here (its model objects, cookies, h11's state machine);
`http.client` a fraction of that (measured: `bench/sglang_server.py`, the
runtime's and raw `/generate`'s client CPU per step). Commands and health
checks keep httpx: they are off the step's path.

What a user of httpx would expect still holds: a proxy named in the
environment (`HTTP_PROXY`/`HTTPS_PROXY`, `NO_PROXY`) is used, HTTPS verifies
against `SSL_CERT_FILE` or certifi's bundle, the connect timeout is separate
from the read timeout, and a connection the server closed while idle is
never used for a request.
"""

from __future__ import annotations

import base64
import http.client
import os
import select
import socket
import ssl
import threading
import urllib.parse
import urllib.request
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


class TransportError(Exception):
    """The server could not be reached, or the connection broke or timed out."""


class TransportTimeout(TransportError):
    """No answer within the timeout (connecting, or reading)."""


class _Response(http.client.HTTPResponse):
    """`http.client`'s response, its headers read without the `email` parser
    (45 us a response here, against 3: a step's answer pays it once, under the
    GIL). `begin` is the standard library's (3.11) but for that line."""

    def begin(self):
        if self.headers is not None:
            return
        while True:  # until a response that is not 100 Continue
            version, status, reason = self._read_status()
            if status != http.client.CONTINUE:
                break
            http.client._read_headers(self.fp)
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        self.headers = self.msg = _headers(self.fp)
        tr_enc = self.headers.get("transfer-encoding")
        self.chunked = bool(tr_enc and tr_enc.lower() == "chunked")
        self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if status in (http.client.NO_CONTENT, http.client.NOT_MODIFIED) or 100 <= status < 200 \
                or self._method == "HEAD":
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


def _headers(fp) -> http.client.HTTPMessage:
    """A well-formed header block as `http.client.parse_headers` reads it (the
    same bounds on count and line length), without `email`'s parser. Where
    that parser keeps the raw text, an obsolete folded line is joined with a
    space (RFC 9112, 5.2); a line that is no header is skipped, where it would
    end the block there."""
    msg = http.client.HTTPMessage()
    name, value = None, ""
    for line in http.client._read_headers(fp):
        text = line.decode("iso-8859-1").rstrip("\r\n")
        if text[:1] in (" ", "\t") and name is not None:  # an obsolete folded continuation
            value += " " + text.strip()
            continue
        if name is not None:
            msg[name] = value
        name, sep, rest = text.partition(":")
        name, value = (name, rest.lstrip(" \t")) if sep and name.strip() == name else (None, "")
    if name is not None:
        msg[name] = value
    return msg


class _OneWrite:
    """The request's head and a bytes body in one write, where `http.client`
    (3.11) writes them apart: each socket call releases the GIL (twice, with a
    timeout: a poll first), a hand-off to another step's thread."""

    def _send_output(self, message_body=None, encode_chunked=False):
        if not isinstance(message_body, bytes) or encode_chunked:
            return super()._send_output(message_body, encode_chunked)
        self._buffer.extend((b"", b""))
        head = b"\r\n".join(self._buffer)
        del self._buffer[:]
        self.send(head + message_body)


class _Connection(_OneWrite, http.client.HTTPConnection):
    response_class = _Response


class _TLSConnection(_OneWrite, http.client.HTTPSConnection):
    response_class = _Response


class DirectResponse:
    """One response, read in the `post` block that made it."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self._conn, self._resp = conn, resp
        self.status = resp.status
        self._broken = False  # a read failed, or hung up: the connection is not kept

    def header(self, name: str) -> Optional[str]:
        return self._resp.getheader(name)

    def read(self) -> bytes:
        try:
            return self._resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(exc) from None

    def iter_lines(self) -> Iterator[bytes]:
        """The body's lines (without their line ends) as they arrive."""
        buf = b""
        while True:
            try:
                data = self._resp.read1(65536)
            except (OSError, http.client.HTTPException) as exc:
                raise self._failed(exc) from None
            if not data:
                break
            buf += data
            if b"\n" in buf:
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    yield line.rstrip(b"\r")
        if buf:
            yield buf.rstrip(b"\r")

    def hang_up(self) -> None:
        """Close the connection from another thread: a read blocked in it returns
        at once (the server sees the client leave: SGLang aborts the request)."""
        self._broken = True
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    @property
    def reusable(self) -> bool:
        return not self._broken and self._resp.isclosed() and not self._resp.will_close \
            and self._conn.sock is not None

    def _failed(self, exc: BaseException) -> TransportError:
        self._broken = True
        if isinstance(exc, TimeoutError):
            return TransportTimeout("no more of the answer came within the timeout")
        return TransportError(f"the connection broke while reading the answer: {type(exc).__name__}: {exc}")


class DirectPool:
    """Thread-safe: each `post` takes an idle connection to the server (or opens
    one) and gives it back when its response was read to the end."""

    def __init__(self, base_url: str, headers: Optional[dict] = None, timeout_s: float = 600.0,
                 connect_s: float = 10.0, max_idle: int = 64):
        self.scheme, self.host, self.port, self.base_path = check_url(base_url)
        self.headers = dict(headers or {})
        self.timeout_s, self.connect_s, self.max_idle = timeout_s, connect_s, max_idle
        self.proxy = proxy_for(base_url)
        self._via: Optional[tuple[str, int]] = None  # the proxy's host and port
        self._proxy_headers: dict = {}
        if self.proxy is not None:
            p = urllib.parse.urlsplit(self.proxy)
            self._via = (p.hostname or "", p.port or (443 if p.scheme == "https" else 80))
            if p.username:
                token = base64.b64encode(f"{urllib.parse.unquote(p.username)}:"
                                         f"{urllib.parse.unquote(p.password or '')}".encode()).decode()
                self._proxy_headers["Proxy-Authorization"] = f"Basic {token}"
            if self.scheme == "http":  # a plain proxy reads each request: the header goes on each
                self.headers.update(self._proxy_headers)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._ssl: Optional[ssl.SSLContext] = None

    @contextmanager
    def post(self, path: str, body: bytes, headers: Optional[dict] = None,
             opened: Optional[Callable[[Callable[[], None]], None]] = None) -> Iterator[DirectResponse]:
        """POST `body` to `path` under the base URL. Raises TransportError when the
        server cannot be reached or the connection breaks before its answer.
        `opened` is given, once connected and before the request is sent, a
        function that hangs up from another thread, before the answer's head
        has come (a server that accepts and never answers) or after it."""
        conn = self._take()
        target = self.base_path + path
        if self.proxy is not None and self.scheme == "http":  # a plain proxy takes the whole URL
            target = f"http://{self.host}:{self.port}{target}"
        out: Optional[DirectResponse] = None

        def hang_up() -> None:
            if out is not None:
                out.hang_up()
            elif conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # getresponse() returns at once, failed
                except OSError:
                    pass

        try:
            if conn.sock is None:
                conn.connect()
                conn.sock.settimeout(self.timeout_s)
            if opened is not None:
                opened(hang_up)
            conn.request("POST", target, body, {**self.headers, **(headers or {})})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            where = f"POST {self.scheme}://{self.host}:{self.port}{target}"
            if isinstance(exc, TimeoutError):
                raise TransportTimeout(f"{where}: timed out") from None
            raise TransportError(f"{where}: {type(exc).__name__}: {exc}") from None
        out = DirectResponse(conn, resp)
        try:
            yield out
        finally:
            self._give(conn, out.reusable)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._new()
            if not _closed_by_peer(conn.sock):
                return conn
            conn.close()

    def _give(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        if reusable:
            with self._lock:
                if len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                    return
        conn.close()

    def _new(self) -> http.client.HTTPConnection:
        host, port = self._via or (self.host, self.port)
        if self.scheme == "https":
            conn: http.client.HTTPConnection = _TLSConnection(
                host, port, timeout=self.connect_s, context=self._context())
            if self._via is not None:  # through the proxy's CONNECT tunnel
                conn.set_tunnel(self.host, self.port, headers=self._proxy_headers)
            return conn
        return _Connection(host, port, timeout=self.connect_s)

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            cafile = os.environ.get("SSL_CERT_FILE")
            if cafile is None:
                import certifi  # httpx's bundle, installed with it

                cafile = certifi.where()
            self._ssl = ssl.create_default_context(cafile=cafile)
        return self._ssl


def check_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path without its trailing /) of an http(s) base URL.
    Raises ValueError naming what is wrong (the flags' check at start uses it)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{url!r}: the port is not a number from 0 to 65535") from None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def proxy_for(url: str) -> Optional[str]:
    """The proxy the environment names for `url` (as httpx and urllib read it), or None."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def _closed_by_peer(sock: Optional[socket.socket]) -> bool:
    """An idle kept-alive connection is readable only when the server closed it
    (or sent what no request asked for): either way it cannot carry a request."""
    if sock is None:
        return False  # never connected: connects on use
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
