"""A start of the SGLang backend that cannot succeed names its cause, and
leaves no process behind."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import psutil
import pytest

from session_runtime.cli import _split_args
from session_runtime.config import RuntimeConfig
from session_runtime.errors import InvalidRequest
from session_runtime.runtime import Runtime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sglang_servers(marker: str) -> set[int]:
    """SGLang servers running with `marker` on their command line."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if "sglang.launch_server" in line and marker in line:
            out.add(p.pid)
    return out


def test_sglang_args_split():
    assert _split_args(["--chunked-prefill-size=2048", "--log-level warning"]) == [
        "--chunked-prefill-size", "2048", "--log-level", "warning"]


def test_a_server_that_exits_during_start_up_is_named_with_its_log(tiny_hf_folder):
    with pytest.raises(InvalidRequest) as err:
        Runtime(RuntimeConfig(model=str(tiny_hf_folder), backend="sglang", template="deepseek", data_dir=None,
                              pool_tokens=2048, sglang_args=("--no-such-flag",)), background=False)
    message = str(err.value)
    assert "SGLang's server exited with code" in message and "--no-such-flag" in message
    assert _sglang_servers("--no-such-flag") == set()


def test_nothing_listening_at_sglang_url():
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(InvalidRequest, match=f"no SGLang server answers at {url}/health"):
        Runtime(RuntimeConfig(backend="sglang", sglang_url=url, data_dir=None), background=False)


class _NotOurs(BaseHTTPRequestHandler):
    """Answers like an SGLang server with its default radix cache."""

    def do_GET(self):
        body = {"/health": {}, "/server_info": {"radix_cache_backend": None, "page_size": 1}}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def log_message(self, *args):
        pass


def test_a_server_without_the_session_backend_is_refused():
    server = HTTPServer(("127.0.0.1", 0), _NotOurs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(InvalidRequest, match="radix-cache backend None; the runtime needs 'session'"):
            Runtime(RuntimeConfig(backend="sglang", sglang_url=url, data_dir=None), background=False)
    finally:
        server.shutdown()


def test_launched_servers_sharing_a_cpu_get_their_share_of_threads():
    """Several launched servers on one CPU each get OMP_NUM_THREADS = their share
    of the cores (all of them on every core decoded 9x slower); the environment's
    own setting wins; GPUs and a single server are left alone."""
    from session_runtime.backends.sglang.launcher import LaunchSpec, launch_env

    spec = LaunchSpec(model_path="m", page_size=16, max_total_tokens=64, dtype="float32", device="cpu",
                      context_length=64, threads=1)
    assert launch_env(spec, {})["OMP_NUM_THREADS"] == "1"
    assert launch_env(spec, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    from dataclasses import replace

    assert "OMP_NUM_THREADS" not in launch_env(replace(spec, threads=None), {})
    assert "OMP_NUM_THREADS" not in launch_env(replace(spec, device="cuda"), {})


# A stand-in for SGLang's server process, as it behaves when its HTTP port is taken: uvicorn logs the
# bind error and the process hangs in shutdown instead of exiting. On a free port it answers /health.
_FAKE_SERVER = r"""
import sys, time, http.server
port = int(sys.argv[1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
except OSError as exc:
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): {exc}", flush=True)
    time.sleep(600)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
server.RequestHandlerClass = Ok
server.serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_is_tried_again_elsewhere(tmp_path, monkeypatch):
    """The launcher picks a free port, and another process may take it before the
    server binds it (SGLang's own servers pick theirs the same way): the server is
    started again on another port at once, not waited for until the start timeout."""
    import sys
    import time
    from dataclasses import dataclass

    import httpx

    from session_runtime.backends.sglang import launcher

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(ports, None) or _free_port())

    @dataclass
    class Spec:
        host: str = "127.0.0.1"
        port: int = 0
        log_path: str = str(tmp_path / "data" / "fake.log")  # a data folder not made yet (the router's log)
        name: str = "the stand-in server"

        def argv(self, port):
            return [sys.executable, "-c", _FAKE_SERVER, str(port)]

    def ready(url):
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    t0 = time.monotonic()
    server = launcher.launch(Spec(), ready, timeout_s=60, env={})
    try:
        assert time.monotonic() - t0 < 30  # not the start timeout
        assert server.url != f"http://127.0.0.1:{taken.getsockname()[1]}" and ready(server.url)
        assert "error while attempting to bind" in (tmp_path / "data" / "fake.log").read_text()  # the first try's
    finally:
        server.stop()
        taken.close()
    with pytest.raises(launcher.PortTaken, match="could not bind port"):  # a port the user named: no retry
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        try:
            launcher.launch(Spec(port=blocker.getsockname()[1]), ready, timeout_s=60, env={})
        finally:
            blocker.close()
