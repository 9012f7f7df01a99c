"""SGLang started as docs/backends.md tells a user to run it for a remote
runtime: every interface (`--host 0.0.0.0`), behind `--api-key`, with two
tensor-parallel ranks on this CPU (`SGLANG_CPU_OMP_THREADS_BIND="0|1"`).

- nothing of ours listens on a port: the server's non-loopback listeners are
  SGLang's own (its HTTP port and torch.distributed's store);
- the runtime connects with the key, and without it is refused at start with
  a message that says so; a command without the key is refused by SGLang;
- part of the conformance suite and the oracle against transformers run on the
  two ranks unchanged, and afterwards both ranks' trees are identical;
- a runtime killed with `kill -9` while 4 conversations hold chains: within
  its lease plus one idle round SGLang's protected size is 0 again and a
  request the size of the pool is served.

One server start (two ranks) for the module."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from session_runtime.backends.sglang import control_client as cc
from session_runtime.errors import InvalidRequest
from tests.api.conftest import start_server
# Run here, on two ranks, unchanged: they take `backend_live` / `sglang_runtime`, overridden below.
from tests.api.test_backends import (  # noqa: F401
    client, test_canonical_branch_in_idle_time, test_chat_completions_continue_the_chain,
    test_concurrent_conversations, test_tool_chain_continuation_and_turn_two_reuse,
)
from tests.backends.test_sglang_oracle import (  # noqa: F401
    hf, test_forced_output_logprobs_equal_teacher_forcing, test_greedy_equals_transformers_cold_and_with_a_cached_prefix,
)
from tests.conftest import SGLANG_CONTEXT, SGLANG_POOL

LOOPBACK = {"127.0.0.1", "::1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks_server(tiny_hf_folder, tmp_path_factory):
    """(url, key, process) of SGLang launched by hand, as the docs show."""
    port, nccl_port, key = _free_port(), _free_port(), secrets.token_hex(16)
    log = tmp_path_factory.mktemp("ranks") / "sglang.log"
    env = {**os.environ, "SESSION_RUNTIME_SGLANG_CPU": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_hf_folder),
            "--skip-tokenizer-init", "--radix-cache-backend", "session", "--device", "cpu",
            "--max-total-tokens", str(SGLANG_POOL), "--page-size", "16", "--sleep-on-idle",
            "--enable-priority-scheduling", "--tp-size", "2", "--host", "0.0.0.0", "--port", str(port),
            "--api-key", key, "--dtype", "float32", "--random-seed", "0",
            "--nccl-port", str(nccl_port)]  # torch.distributed's store, pinned so the listener test can name it
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"SGLang with --tp-size 2 exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang with --tp-size 2 did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, key, proc, nccl_port
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def _runtime(folder, url: str, key, **overrides):
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    return Runtime(RuntimeConfig(model=str(folder), backend="sglang", sglang_url=url, sglang_api_key=key,
                                 page_size=16, pool_tokens=SGLANG_POOL, template="deepseek", data_dir=None,
                                 offload="never", **overrides), background=False)


@pytest.fixture(scope="module")
def sglang_runtime(ranks_server, tiny_hf_folder):
    url, key, *_ = ranks_server
    rt = _runtime(tiny_hf_folder, url, key)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def backend_live(sglang_runtime):
    live = start_server(sglang_runtime)
    yield live
    live.stop()


def test_the_two_ranks_are_read_from_the_server(sglang_runtime):
    backend = sglang_runtime.backend
    assert backend.tp_size == 2 and backend.max_context == SGLANG_CONTEXT
    assert backend.control.call("ping")["tp_size"] == 2


def test_nothing_of_ours_listens_beyond_loopback(ranks_server):
    """On other interfaces than loopback the server listens on SGLang's HTTP port
    and on torch.distributed's store (SGLang's `--nccl-port`, pinned here), as
    plain SGLang does; nothing on the old control channel's port (SGLang's port
    +/- 2048) or any other."""
    url, _, proc, nccl_port = ranks_server
    http_port = int(url.rsplit(":", 1)[1])
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    listeners = []
    for p in tree:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        listeners += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    wide = {port for _, ip, port in listeners if ip not in LOOPBACK}
    assert http_port in wide, listeners
    assert wide <= {http_port, nccl_port}, listeners
    assert not {http_port + 2048, http_port - 2048} & {port for *_, port in listeners}, listeners


def test_the_runtime_needs_the_servers_key(ranks_server, tiny_hf_folder):
    url, key, *_ = ranks_server
    with pytest.raises(InvalidRequest, match="refused the runtime's API key"):
        _runtime(tiny_hf_folder, url, None)
    with pytest.raises(InvalidRequest, match="refused the runtime's API key"):
        _runtime(tiny_hf_folder, url, "not-the-key")
    with pytest.raises(cc.Unauthorized, match="--sglang-api-key"):
        cc.RequestControl(url, cc.client(None)).call("snapshot")
    resp = httpx.post(f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 401


def test_both_ranks_trees_are_identical_after_a_mixed_workload(sglang_runtime):
    rt = sglang_runtime
    tool = {"reasoning": "A tool first. " * 3, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    cids = [rt.create_conversation(system=f"Two ranks, one tree {i}. " * 6, policy=p, materialize="always")
            for i, p in enumerate(("drop", "keep", "drop"))]
    try:
        for cid in cids:
            rt.send_message(cid, "Use the tool.", forced=tool)
            call = rt.describe(cid)["pending_tool_calls"][0]["id"]
            rt.send_tool_results(cid, [{"tool_call_id": call, "content": "ok"}],
                                 forced={"reasoning": "Done.", "content": "Finished. " * 6})
            rt.send_message(cid, "Again, freely.", max_tokens=6)
        rt.materializer.run_pending()
        rt.delete_conversation(cids[1])
        checked = rt.backend.control.call("check")
        assert checked["ranks"] == 2 and checked["checked"] == "full"
        report = rt.integrity()  # what /debug/tree?check=true shows the admin
        assert report["ok"] and report["ranks"] == 2 and report["digest"] == checked["digest"]
    finally:
        for cid in cids:
            if cid in rt.conversations:
                rt.delete_conversation(cid)


def test_a_dead_runtimes_chains_go_back_to_the_lru_after_its_lease(ranks_server, tiny_hf_folder, tmp_path):
    url, key, *_ = ranks_server
    control = cc.RequestControl(url, cc.client(key))
    assert control.call("pools")["chains"] == {}
    port = _free_port()
    lease = 3.0
    env = {**os.environ, "SGLANG_API_KEY": key}
    serve = subprocess.Popen(
        [sys.executable, "-m", "session_runtime.cli", "serve", "--backend", "sglang", "--sglang-url", url,
         "--model", str(tiny_hf_folder), "--template", "deepseek", "--page-size", "16", "--pool-tokens",
         str(SGLANG_POOL), "--chain-lease-s", str(lease), "--data-dir", str(tmp_path), "--port", str(port)],
        env=env, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=120) as http:
            for i in range(4):
                cid = http.post("/v1/conversations", json={"system": f"Leased chain {i}. " * 8,
                                                           "policy": "keep"}).json()["id"]
                r = http.post(f"/v1/conversations/{cid}/messages",
                              json={"content": "Hold this.", "forced": {"content": "Held. " * 10}})
                assert r.status_code == 200, r.text
        pools = control.call("pools")
        assert len(pools["chains"]) == 4 and pools["protected"] > 0
        os.killpg(serve.pid, signal.SIGKILL)
        killed = time.monotonic()
        while control.call("pools")["protected"] > 0:
            assert time.monotonic() - killed < lease + 5, control.call("pools")
            time.sleep(0.25)
        assert control.call("pools")["chains"] == {}
        # The pool can be filled by new requests: one prompt of most of it is served.
        resp = httpx.post(f"{url}/generate", headers={"Authorization": f"Bearer {key}"}, timeout=300, json={
            "input_ids": list(range(5000, 5000 + SGLANG_POOL - 64)), "sampling_params": {"max_new_tokens": 1}})
        assert resp.status_code == 200, resp.text
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=30)
