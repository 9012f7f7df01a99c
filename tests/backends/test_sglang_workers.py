"""Two real SGLang workers on this CPU behind one runtime: affinity, drain,
`kill -9` of a worker under traffic, and its return.

Worker w0 is the test session's shared server (given by URL, as
`--sglang-url` does); w1 is launched by the runtime itself (`workers=1`), so
this module costs one server start. The kill test kills w1 (the runtime then
starts it again, as it does for any server it launched), so it runs after the
others."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from session_runtime.errors import BackendUnavailable
from tests.conftest import SGLANG_CONTEXT, SGLANG_POOL

SYSTEM = "Workers share nothing but the runtime. " * 8
CALL = {"reasoning": "Tool first.", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
DONE = {"reasoning": "Done.", "content": "Finished."}


@pytest.fixture(scope="module")
def pool(sglang_runtime, tiny_hf_folder):
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    rt = Runtime(RuntimeConfig(model=str(tiny_hf_folder), backend="sglang", sglang_url=sglang_runtime.backend.url,
                               workers=1, page_size=16, pool_tokens=SGLANG_POOL, max_context=SGLANG_CONTEXT,
                               template="deepseek", data_dir=None, offload="never", idle_ttl_s=0),
                 background=False)
    yield rt
    rt.close()


def _where(rt, cid):
    return rt.describe(cid)["worker"]


def test_conversations_spread_and_each_turn_hits_its_own_worker(pool):
    rt = pool
    assert sorted(rt.backend.workers) == ["w0", "w1"] and rt.backend.workers["w1"].server is not None
    cids = [rt.create_conversation(system=SYSTEM + str(i), policy="drop", tenant="workers") for i in range(6)]
    try:
        where = {c: _where(rt, c) for c in cids}
        counts = {w: list(where.values()).count(w) for w in ("w0", "w1")}
        assert all(0 < n <= 4 for n in counts.values()), counts  # bounded: ceil(1.25 * 6 / 2) = 4
        for c in cids:
            rt.send_message(c, "Hi", forced=DONE)
        for c in cids:
            acc = rt.send_message(c, "Again", forced=DONE).accounting
            assert acc.cached_input_tokens > 0  # the chain of turn 1 is on the worker turn 2 went to
            mine, other = where[c], {"w0": "w1", "w1": "w0"}[where[c]]
            assert rt.backend.workers[mine].chain_tokens(c) > 0
            assert rt.backend.workers[other].chain_tokens(c) == 0
            assert _where(rt, c) == mine
        nodes = rt.tree_snapshot(worker="w1")
        assert all(set(n.owners) <= {c for c in cids if where[c] == "w1"} for n in nodes if n.owners)
        health = {w["id"]: w for w in rt.backend.describe_workers()}
        assert health["w0"]["up"] and health["w1"]["up"] and health["w1"]["conversations"] == counts["w1"]
    finally:
        for c in cids:
            rt.delete_conversation(c)
    rt.check_integrity()


def test_a_drained_worker_hands_its_conversations_over(pool):
    rt = pool
    cids = [rt.create_conversation(system=SYSTEM + "drain" + str(i), policy="drop", tenant="workers")
            for i in range(4)]
    try:
        for c in cids:
            rt.send_message(c, "Hi", forced=DONE)
        on_w1 = [c for c in cids if _where(rt, c) == "w1"]
        assert on_w1
        moved = rt.drain_worker("w1")
        assert sorted(moved) == sorted(on_w1)
        assert all(rt.backend.workers["w1"].chain_tokens(c) == 0 for c in on_w1)  # released there
        for c in cids:
            acc = rt.send_message(c, "Again", forced=DONE).accounting
            assert _where(rt, c) == "w0"
            if c in on_w1:  # rebuilt on w0 by prefill, and counted
                assert acc.recomputed_history_tokens > 0
        new = rt.create_conversation(system=SYSTEM, tenant="workers")
        assert _where(rt, new) == "w0"  # nothing is placed on a draining worker
        rt.delete_conversation(new)
        rt.backend.undrain("w1")
    finally:
        for c in cids:
            rt.delete_conversation(c)


def test_kill_9_of_a_worker_under_traffic_loses_no_acknowledged_step(pool):
    """Four agents step in a loop (a tool call, its result and the answer, four
    turns), retrying a step that fails with the retryable 503; w1's server gets
    SIGKILL once six steps are acknowledged, with requests in flight. Every
    acknowledged step is in its conversation afterwards, nothing else is, and
    w1's conversations go on on w0 (their history rebuilt by prefill)."""
    rt = pool
    cids = [rt.create_conversation(system=SYSTEM + "kill" + str(i), policy="drop", tenant="workers")
            for i in range(4)]
    on_w1 = {c for c in cids if _where(rt, c) == "w1"}
    assert on_w1 and len(on_w1) < len(cids)
    acked = {c: 0 for c in cids}
    failed: list[str] = []

    def agent(cid: str) -> None:
        for turn in range(4):
            for kind in ("call", "result"):
                while True:
                    try:
                        if kind == "call":
                            rt.send_message(cid, f"Turn {turn}", forced=CALL)
                        else:
                            call_id = rt.describe(cid)["pending_tool_calls"][0]["id"]
                            rt.send_tool_results(cid, [{"tool_call_id": call_id, "content": "ok"}], forced=DONE)
                        acked[cid] += 1
                        break
                    except BackendUnavailable:  # retryable: the step changed nothing
                        failed.append(cid)
                        time.sleep(0.2)

    threads = [threading.Thread(target=agent, args=(c,)) for c in cids]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 300
        while sum(acked.values()) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(rt.backend.workers["w1"].server.process.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
        for c in cids:
            d = rt.describe(c)
            assert sum(len(t["steps"]) for t in d["turns"]) == acked[c] == 8, (c, d["turns"], acked[c])
            assert len(d["turns"]) == 4 and not d["pending_tool_calls"]
            assert d["worker"] == "w0"  # w1's conversations moved; w0's stayed
        assert set(failed) <= on_w1 and rt.backend.moves >= len(on_w1)
        rt.backend.workers["w0"].check_integrity()
    finally:
        for c in cids:
            rt.delete_conversation(c)


def test_a_worker_that_comes_back_rejoins(pool):
    """The runtime starts the killed server again (it launched it); once its
    /health answers, the pool marks it up and places new conversations on it."""
    rt = pool
    w1 = rt.backend.workers["w1"]
    try:
        w1.chain_tokens("nobody")  # the first call to a dead launched server starts it again
    except BackendUnavailable:
        pass
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline and not rt.backend.check_health()["w1"]:
        time.sleep(2)
    assert rt.backend.check_health()["w1"], "w1 did not come back"
    cids = [rt.create_conversation(system=SYSTEM + "back" + str(i), tenant="workers") for i in range(4)]
    try:
        assert "w1" in {_where(rt, c) for c in cids}
        c = next(c for c in cids if _where(rt, c) == "w1")
        assert rt.send_message(c, "Hi", forced=DONE).accounting.prompt_tokens > 0
    finally:
        for c in cids:
            rt.delete_conversation(c)
