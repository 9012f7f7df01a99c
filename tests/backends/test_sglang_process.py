"""`session-runtime serve --backend sglang --model tiny` as a user runs it:
the preset is saved as a Hugging Face folder under the data directory and
served by a launched SGLang server; an SGLang that dies gives 503 and loses
no conversation, comes back by itself, and the next step rebuilds the KV by
prefill (counted as recomputed); SIGTERM stops SGLang's processes too.

Two SGLang starts (the launch and the restart): the slowest test here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.prometheus import parse

FORCED = {"reasoning": "Two and two make four.", "content": "2 + 2 = 4."}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the runtime exited with {proc.returncode} while waiting for {what}")
        got = predicate()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _sglang_children(pid: int) -> list[psutil.Process]:
    """The launched SGLang servers under the runtime (zombies left out): its
    own children, not their processes (with a tokenizer, others of SGLang's
    processes carry the server's command line too, listed in no set order)."""
    out = []
    for p in psutil.Process(pid).children(recursive=False):
        try:
            if "sglang.launch_server" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # gone, or a zombie not yet reaped
            pass
    return out


def _ok(client: httpx.Client, path: str):
    try:
        return client.get(path).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("sglang-serve")
    port = _port()
    log = open(data / "runtime.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "session_runtime.cli", "serve", "--backend", "sglang", "--model", "tiny",
         "--data-dir", str(data), "--port", str(port), "--pool-tokens", "2048", "--max-context", "1024"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    try:
        _wait(lambda: _ok(client, "/health"), 600, "the runtime to serve", proc)
        yield proc, client, data
    finally:
        client.close()
        if proc.poll() is None:
            for child in _sglang_children(proc.pid):
                os.killpg(child.pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_the_preset_is_served_by_sglang(served):
    proc, client, data = served
    models = list((data / "models").iterdir())
    assert [m.name for m in models] == ["tiny-seed0-v129280"]
    # Its random weights, and the runtime's tokenizer for the server's grammar backend.
    assert {p.name for p in models[0].iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"}
    assert len(_sglang_children(proc.pid)) >= 1
    assert "SGLang server at http://127.0.0.1:" in (data / "runtime.log").read_text()


def test_sglang_dies_and_comes_back(served):
    proc, client, data = served
    cid = client.post("/v1/conversations", json={"system": "You are terse in a restart test.", "policy": "drop",
                                                  "materialize": "never"}).json()["id"]
    first = client.post(f"/v1/conversations/{cid}/messages", json={"content": "What is 2+2?", "forced": FORCED})
    assert first.status_code == 200, first.text
    before = client.get(f"/v1/conversations/{cid}").json()

    launcher = _sglang_children(proc.pid)[0]
    os.killpg(launcher.pid, signal.SIGKILL)
    _wait(lambda: not _sglang_children(proc.pid) or not launcher.is_running(), 30, "SGLang to die")

    r = client.post(f"/v1/conversations/{cid}/messages", json={"content": "And 3+3?", "max_tokens": 4})
    assert r.status_code == 503, r.text
    body = r.json()["error"]
    assert body["type"] == "backend_unavailable" and "SGLang" in body["message"] and "retry" in body["message"]
    # Nothing was lost or changed: the conversation's layers are the runtime's
    # own; only its chain (physical state, now unknown) is not reported.
    during = client.get(f"/v1/conversations/{cid}").json()
    assert during["chain"]["cached_tokens"] is None
    assert {k: v for k, v in during.items() if k != "chain"} == {k: v for k, v in before.items() if k != "chain"}
    up = parse(client.get("/metrics").text)["session_runtime_backend_up"]
    health = client.get("/health")
    # Down until the restart (begun by the step above, or by the lease heartbeat
    # when it noticed first) is back; on a loaded machine it can be back already.
    back = "SGLang's server is back" in (data / "runtime.log").read_text()
    assert up == 0 or back
    assert (health.status_code == 503 and health.json()["status"] == "backend_unavailable") or back, health.text

    def step():
        r = client.post(f"/v1/conversations/{cid}/messages", json={"content": "And 3+3?", "forced": FORCED})
        assert r.status_code in (200, 503), r.text
        return r.json() if r.status_code == 200 else None

    again = _wait(step, 600, "SGLang to come back", proc)
    acc = again["accounting"]
    # The new server's tree is empty: the whole prompt is prefilled, the
    # history counted as recomputed.
    assert acc["cached_input_tokens"] == 0
    assert acc["recomputed_history_tokens"] == before["turns"][0]["steps"][-1]["active_context_length"]
    assert client.get("/debug/tree").json()["chains"][cid] > 0


def test_sigterm_stops_sglang_within_seconds(served):
    proc, client, data = served
    children = _sglang_children(proc.pid)
    group = [p for c in children for p in [c, *c.children(recursive=True)]]
    assert group
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    _wait(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group), 20,
          "SGLang's processes to exit")
    assert time.monotonic() - t0 < 30
