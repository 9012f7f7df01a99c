"""Shared fixtures of the HTTP tests: in-process uvicorn servers over Runtimes
built in the test process (importing SGLang costs ~18 s per process, so no
subprocess servers), spoken to over loopback with httpx and the openai client.

One session-scoped Runtime (pool 16384 tokens, context 512, page 16, no
background materializer) and its server are shared by test_session_api.py and
test_openai.py; every test makes its own conversations with a unique system
prompt, so exact cache numbers do not depend on test order.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import httpx
import pytest

from tests import prometheus

PAGE = 16
MAX_CONTEXT = 512
TINY_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # K+V, 4 layers, 2 kv heads, head_dim 64, float32


@dataclass
class LiveServer:
    runtime: object
    app: object
    server: object
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def start_server(runtime, settings=None) -> LiveServer:
    """uvicorn in a daemon thread on a pre-bound loopback socket (no port race);
    `settings` (ApiSettings: keys, limits) default to an open server."""
    import uvicorn

    from session_runtime.api.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(runtime, settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return LiveServer(runtime, app, server, thread, port)


def build_runtime(**overrides):
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    cfg = dict(model="tiny", page_size=PAGE, pool_tokens=16384, max_context=MAX_CONTEXT, data_dir=None)
    cfg.update(overrides)
    return Runtime(RuntimeConfig(**cfg), background=False)


@contextlib.contextmanager
def served(settings=None, **overrides) -> Iterator[LiveServer]:
    """A fresh Runtime and its server; both closed on exit."""
    rt = build_runtime(**overrides)
    live = None
    try:
        live = start_server(rt, settings)
        yield live
    finally:
        if live is not None:
            live.stop()
        rt.close()


@pytest.fixture(scope="session")
def live():
    with served() as s:
        yield s


@pytest.fixture(scope="session")
def client(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c


@pytest.fixture
def rt(live):
    """The shared runtime; its integrity is checked after every test."""
    yield live.runtime
    live.runtime.check_integrity()


# ----- helpers --------------------------------------------------------------


def create(client: httpx.Client, **body) -> str:
    r = client.post("/v1/conversations", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def step_ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response, status: int, kind: Optional[str] = None) -> str:
    """Assert the `{"error": {"type", "message"}}` shape and the status; returns the message."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if kind is not None:
        assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def openai_error_of(r: httpx.Response, status: int, kind: str, code: Optional[str] = None,
                    param: Optional[str] = None) -> str:
    """Assert OpenAI's `{"error": {"message", "type", "param", "code"}}` shape,
    the status, type, code and param; returns the message."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (kind, code, param), body
    return body["error"]["message"]


def snapshot(client: httpx.Client, cid: str) -> tuple:
    """What a failed request must leave as it was: the conversation with its
    token ids, and its nodes of the tree (hit counts and ages aside)."""
    conv = client.get(f"/v1/conversations/{cid}", params={"tokens": 1})
    assert conv.status_code == 200, conv.text
    tree = client.get("/debug/tree", params={"conversation": cid}).json()
    nodes = sorted((n["id"], n["parent"], n["tokens"], n["lock_count"], tuple(n["owners"])) for n in tree["nodes"])
    return conv.json(), nodes, tree["chains"].get(cid)


def pool_state(rt) -> tuple:
    tree = rt.engine.tree
    return rt.engine.pools.allocator.available_size(), tree.protected_size(), tree.evictable_size()


def sse_events(lines: Iterator[str]) -> list:
    """Parse `data: ...` lines up to and including `[DONE]` (kept as the string)."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            out.append(data)
            break
        out.append(json.loads(data))
    return out


def stream(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, list]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        assert r.headers["content-type"].startswith("text/event-stream")
        return r, sse_events(r.iter_lines())


def metrics(client: httpx.Client) -> dict[str, float]:
    """/metrics' series by name (labels included), read with Prometheus' parser."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return prometheus.parse(r.text)


def first_prompt_len(rt, system: Optional[str], content: str) -> int:
    """bos + system + <User> content <Assistant> + <think>."""
    enc = rt.tokenizer.encode
    return 1 + (len(enc(system)) if system else 0) + 1 + len(enc(content)) + 1 + 1


def serve_cli(data_dir, *flags: str):
    """`session-runtime serve` in its own process on a free loopback port, once it
    says it listens; returns (process, url)."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "session_runtime.cli", "serve", "--port", str(port),
                             "--data-dir", str(data_dir), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if "listening on" in line:
            return proc, f"http://127.0.0.1:{port}"
    raise AssertionError("the server did not start")
