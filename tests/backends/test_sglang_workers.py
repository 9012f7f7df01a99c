"""Two real SGLang workers on this CPU behind one runtime: affinity, stateless
requests through sglang-router, drain, `kill -9` of a worker under traffic, and
its return.

Worker w0 is the test session's shared server (given by URL, as
`--sglang-url` does); w1 is launched by the runtime itself (`workers=1`), so
this module costs one server start; the runtime launches sglang-router over
both (a Rust binary: seconds). The kill test kills w1 (the runtime then
starts it again, as it does for any server it launched), so it runs after the
others."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from session_runtime.backends.sglang.router import routed_namespace
from session_runtime.errors import BackendUnavailable
from session_runtime.templates.base import Message
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


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


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


def test_stateless_requests_go_through_the_router_to_the_worker_that_caches_their_prefix(pool):
    """/v1/chat/completions without a conversation_id goes through sglang-router
    (cache_aware), `input_ids` and all. A long request through the router keeps
    one worker busy (X); a fresh prefix B then goes to the least loaded worker
    (Y); afterwards B's second request and A's go to the worker that caches their
    prefix (when both are idle, a fresh prefix would go to the same first one:
    so one of the two is routed by its prefix, not by the tie), and hit there."""
    from tests.api.conftest import start_server

    rt = pool
    router = rt.backend.router
    assert router is not None and router.router is not None and router.router.alive()  # launched over w0, w1
    tpl = rt.template("deepseek")
    tag = uuid.uuid4().hex[:8]  # prefixes no tree and no router has seen
    systems = {k: f"{k} {tag}: stateless traffic shares this long system prompt. " * 24 for k in "AB"}
    head = {k: tpl.render(v, [], [], lambda turn: True, False).ids for k, v in systems.items()}
    probe_cid = rt.create_conversation(system="namespace")
    ns = routed_namespace(rt.namespace(rt.get(probe_cid)))
    rt.delete_conversation(probe_cid)
    steps_before = router.steps
    server = start_server(rt)
    try:
        def chat(key: str, text: str) -> dict:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "system", "content": systems[key]}, {"role": "user", "content": text}],
                "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r.json()

        def holders(key: str) -> set[str]:
            return {wid for wid, w in rt.backend.workers.items() if w.probe(ns, head[key]).device_len > 0}

        busy = {"input_ids": head["A"] + [100], "stream": True, "extra_key": ns.extra_key,
                "sampling_params": {"max_new_tokens": 600, "temperature": 0.0, "ignore_eos": True}}
        with httpx.stream("POST", f"{router.url}/generate", json=busy, timeout=300) as long:
            lines = long.iter_lines()  # kept: a dropped line iterator closes the stream
            next(line for line in lines if line.startswith("data:"))  # running: its worker's load is 1
            first = chat("B", "Hi")
        second, other = chat("B", "Again"), chat("A", "Again")
        x, y = holders("A"), holders("B")
        assert len(x) == len(y) == 1 and x != y, (x, y)
        # What the worker reports as cached: whole pages of the prefix its tree shares with the prompt.
        prompt = {(k, t): tpl.render(systems[k], [], [Message("user", 0, content=t)], lambda turn: True, True).ids
                  for k, t in (("B", "Hi"), ("B", "Again"), ("A", "Again"))}
        shared = _common(prompt["B", "Hi"], prompt["B", "Again"])
        assert shared > len(head["B"]) and len(head["A"]) >= 300
        expected = {id(first): 0, id(second): shared // 16 * 16, id(other): len(head["A"]) // 16 * 16}
        for answer in (first, second, other):
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == expected[id(answer)]
            assert answer["accounting"]["cached_input_tokens"] == expected[id(answer)]
        assert router.steps - steps_before == 3
        assert not rt.backend.stateless and not any(c in rt.backend.where for c in
                                                    (first["conversation_id"], second["conversation_id"]))
    finally:
        server.stop()
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
                # What w1 held is lost with it (but for what w0 holds of the shared system
                # prompt in a page it cannot share); the dropped reasoning's answer was never computed.
                got = {e["reason"] for e in acc.uncached}
                assert {"new_input", "policy_fork", "backend_lost"} <= got <= {
                    "new_input", "policy_fork", "backend_lost", "page_alignment"}
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


def test_a_conversation_whose_worker_is_known_down_moves_on_its_next_step(pool):
    """Once /health lists a worker as down, the next step of a conversation
    placed on it is served at once by a live worker (200, its history
    prefilled there), not refused and not left waiting on the dead one."""
    rt = pool
    cids = [rt.create_conversation(system=SYSTEM + "down" + str(i), policy="drop", tenant="workers")
            for i in range(6)]
    try:
        on_w1 = [c for c in cids if _where(rt, c) == "w1"]
        assert on_w1, "no conversation was placed on w1"
        for c in on_w1:
            rt.send_message(c, "First turn.", forced=DONE)
        os.killpg(rt.backend.workers["w1"].server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while rt.backend.check_health()["w1"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {w["id"]: w["up"] for w in rt.backend.describe_workers()}["w1"] is False
        for c in on_w1:
            t0 = time.monotonic()
            step = rt.send_message(c, "Second turn.", forced=DONE)
            assert time.monotonic() - t0 < 20 and _where(rt, c) == "w0"
            assert step.accounting.recomputed_history_tokens > 0  # rebuilt by prefill on w0
            lost = {e["reason"]: e["tokens"] for e in step.accounting.uncached}
            assert {"new_input", "policy_fork", "backend_lost"} <= set(lost) <= {
                "new_input", "policy_fork", "backend_lost", "page_alignment"}
            assert sum(lost.values()) == step.accounting.uncached_prefill_tokens
    finally:
        for c in cids:
            rt.delete_conversation(c)
