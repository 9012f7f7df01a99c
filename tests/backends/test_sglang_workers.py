"""Two real SGLang workers on this CPU behind one runtime: affinity, stateless
requests placed by their inferred conversation, drain, `kill -9` of a worker under traffic, and
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


def test_stateless_requests_are_placed_by_their_inferred_conversation(pool):
    """/v1/chat/completions without a conversation_id (a harness sending its
    whole history) is a step of the conversation the history continues: the
    first request creates and places it like any conversation, the next one
    goes to the worker holding its chain and hits there; sglang-router's
    prefix guess is not asked (issue 38, item 6)."""
    from tests.api.conftest import start_server

    rt = pool
    router = rt.backend.router
    tag = uuid.uuid4().hex[:8]
    steps_before = router.steps
    server = start_server(rt)
    cids: dict[int, str] = {}
    try:
        for i in range(4):  # four sessions: both workers get some
            history = [{"role": "system", "content": f"Session {i} {tag}. " + SYSTEM},
                       {"role": "user", "content": "Hi"}]
            answers = []
            for text in ("Again", "Once more"):
                r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                               json={"messages": history, "max_tokens": 2})
                assert r.status_code == 200, r.text
                answers.append(r.json())
                message = r.json()["choices"][0]["message"]
                history += [{"role": "assistant", "content": message["content"] or "",
                             "reasoning_content": message.get("reasoning_content")},
                            {"role": "user", "content": text}]
            assert len({a["conversation_id"] for a in answers}) == 1, answers
            cids[i] = cid = answers[0]["conversation_id"]
            conv = rt.get(cid)
            assert conv.inferred == "openai-chat" and len(conv.turns) == 2
            mine = _where(rt, cid)
            other = {"w0": "w1", "w1": "w0"}[mine]
            assert rt.backend.workers[mine].chain_tokens(cid) > 0 and rt.backend.workers[other].chain_tokens(cid) == 0
            second = answers[1]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
                second["accounting"]["cached_input_tokens"] > 0  # the second request hit its chain on `mine`
        assert {_where(rt, c) for c in cids.values()} == {"w0", "w1"}
        assert router.steps == steps_before and not rt.backend.stateless
    finally:
        server.stop()
        for cid in cids.values():  # w0 is the session's shared server: leave it no chain
            rt.delete_conversation(cid)
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


def _traffic(rt, cids, acked, failed, done, retry_s=0.2, turns=4):
    """Agents that step in a loop (a tool call, its result and the answer,
    `turns` turns), retrying a step that fails with the retryable 503; each
    acknowledged step's time goes into acked[cid]."""

    def agent(cid: str) -> None:
        for turn in range(turns):
            for kind in ("call", "result"):
                while not done.is_set():
                    try:
                        if kind == "call":
                            rt.send_message(cid, f"Turn {turn}", forced=CALL)
                        else:
                            call_id = rt.describe(cid)["pending_tool_calls"][0]["id"]
                            rt.send_tool_results(cid, [{"tool_call_id": call_id, "content": "ok"}], forced=DONE)
                        acked[cid].append(time.monotonic())
                        break
                    except BackendUnavailable:  # retryable: the step changed nothing
                        failed.append(cid)
                        time.sleep(retry_s)

    threads = [threading.Thread(target=agent, args=(c,)) for c in cids]
    for t in threads:
        t.start()
    return threads


def _conversations(rt, tag: str, victim: str) -> tuple[list[str], set[str]]:
    """Four conversations, and those of them placed on `victim` (some, not all)."""
    cids = [rt.create_conversation(system=SYSTEM + tag + str(i), policy="drop", tenant="workers") for i in range(4)]
    on_victim = {c for c in cids if _where(rt, c) == victim}
    assert on_victim and len(on_victim) < len(cids)
    return cids, on_victim


def _wait_acked(acked: dict, n: int) -> None:
    deadline = time.monotonic() + 300
    while sum(map(len, acked.values())) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def _recovered(acked: dict, cids, since: float) -> dict:
    """Seconds from `since` to each conversation's first acknowledged step after it."""
    return {c: min((t for t in acked[c] if t > since), default=float("inf")) - since for c in cids}


def _lost_after(rt, cid: str, steps_before: int) -> set:
    """The uncached reasons of the conversation's steps after its first `steps_before`."""
    steps = [st for t in rt.describe(cid)["turns"] for st in t["steps"]][steps_before:]
    return {e["reason"] for st in steps for e in st["uncached"]}


def test_kill_9_of_a_worker_under_traffic_loses_no_acknowledged_step(pool):
    """What an operator does: four agents step in a loop and w1's whole process
    tree (its server and its scheduler processes) gets SIGKILL once six steps
    are acknowledged, with requests in flight, and the agents keep stepping.
    Each of w1's conversations has a step acknowledged within 5 s of the death,
    on w0, its history rebuilt by prefill (`backend_lost`); w0's conversations
    count nothing lost; every acknowledged step is in its conversation
    afterwards, nothing else is."""
    rt = pool
    cids, on_w1 = _conversations(rt, "kill", "w1")
    acked: dict = {c: [] for c in cids}
    failed: list[str] = []
    done = threading.Event()
    threads = _traffic(rt, cids, acked, failed, done)
    try:
        _wait_acked(acked, 6)
        before = {c: len(acked[c]) for c in cids}
        server = rt.backend.workers["w1"].server
        tree = [server.process.pid, *server.members]
        assert len(tree) >= 3, tree  # the server, its scheduler and its detokenizer
        killed_at = time.monotonic()
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
        recovery = _recovered(acked, on_w1, killed_at)
        assert max(recovery.values()) <= 5.0, recovery
        for c in cids:
            d = rt.describe(c)
            assert sum(len(t["steps"]) for t in d["turns"]) == len(acked[c]) == 8, (c, d["turns"], acked[c])
            assert len(d["turns"]) == 4 and not d["pending_tool_calls"]
            assert d["worker"] == "w0"  # w1's conversations moved; w0's stayed
            assert ("backend_lost" in _lost_after(rt, c, before[c])) == (c in on_w1), c
        assert set(failed) <= on_w1 and rt.backend.moves >= len(on_w1)
        rt.backend.workers["w0"].check_integrity()
    finally:
        done.set()
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


def test_a_hung_worker_is_left_within_seconds_and_rejoins_when_it_answers(pool):
    """w0 (given by URL, as --sglang-url) stops answering with requests in
    flight: SIGSTOP of its whole process group, so it still accepts
    connections and never answers. Its steps in flight fail retryably and its
    conversations go on on w1 within 5 s of the stop; once it runs again
    (SIGCONT) it rejoins, and nothing acknowledged is lost."""
    rt = pool
    w0 = rt.backend.workers["w0"]
    assert w0.server is None and rt.backend.check_health() == {"w0": True, "w1": True}
    cids, on_w0 = _conversations(rt, "hung", "w0")
    acked: dict = {c: [] for c in cids}
    failed: list[str] = []
    done = threading.Event()
    pgid = os.getpgid(_server_pid(w0.url))
    threads = _traffic(rt, cids, acked, failed, done, turns=3)
    try:
        _wait_acked(acked, 4)
        stopped_at = time.monotonic()
        os.killpg(pgid, signal.SIGSTOP)
        try:
            while time.monotonic() < stopped_at + 30 and max(_recovered(acked, on_w0, stopped_at).values()) > 30:
                time.sleep(0.1)
            recovery = _recovered(acked, on_w0, stopped_at)
            assert max(recovery.values()) <= 5.0, recovery
            assert {w["id"]: w["up"] for w in rt.backend.describe_workers()}["w0"] is False
        finally:
            os.killpg(pgid, signal.SIGCONT)
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
        deadline = time.monotonic() + 30
        while not rt.backend.check_health()["w0"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rt.backend.check_health()["w0"], "w0 did not rejoin once it answered again"
        for c in cids:
            d = rt.describe(c)
            assert sum(len(t["steps"]) for t in d["turns"]) == len(acked[c]) == 6, (c, d["turns"], acked[c])
            assert d["worker"] == "w1"  # w0's moved; w1's stayed
        assert set(failed) <= on_w0
        w0.check_integrity()
    finally:
        done.set()
        for c in cids:
            rt.delete_conversation(c)


def _server_pid(url: str) -> int:
    """The pid of the process that listens on the URL's port (from /proc/net/tcp)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").strip("socket:[]") in inodes for fd in fds):
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")


def test_a_conversation_whose_worker_is_known_down_moves_on_its_next_step(pool):
    """w1's scheduler and detokenizer die, its server process lives on (and
    answers nothing): once /health lists it as down, the next step of a
    conversation placed on it is served at once by a live worker (200, its
    history prefilled there), not refused and not left waiting on the dead
    one, and the runtime starts w1 again (it launched it)."""
    rt = pool
    cids = [rt.create_conversation(system=SYSTEM + "down" + str(i), policy="drop", tenant="workers")
            for i in range(6)]
    try:
        on_w1 = [c for c in cids if _where(rt, c) == "w1"]
        assert on_w1, "no conversation was placed on w1"
        for c in on_w1:
            rt.send_message(c, "First turn.", forced=DONE)
        w1 = rt.backend.workers["w1"]
        for pid in w1.server.members:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while rt.backend.check_health()["w1"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {w["id"]: w["up"] for w in rt.backend.describe_workers()}["w1"] is False
        assert w1.revive(), "the runtime does not start w1 again"
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
