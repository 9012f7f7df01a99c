"""Regression tests for interleavings a review found: each forces one ordering
the locks allow (a hook runs one thread's work inside another's window)."""

from __future__ import annotations

import threading
import time

import pytest

from session_runtime import Runtime, RuntimeConfig


def words(n: int, w: str = "alpha") -> str:
    return (" " + w) * n


@pytest.fixture
def rt():
    runtime = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=4096, host_pool_tokens=4096,
                                    max_context=2048), background=False)
    yield runtime
    runtime.close()


def tool_turn(rt, cid, reasoning=20):
    return rt.send_message(cid, words(5), forced={"reasoning": words(reasoning),
                                                  "tool_calls": [{"name": "f", "arguments": {}}]})


def test_a_split_inside_the_tail_during_the_copy_cancels_the_demotion(rt):
    x = rt.create_conversation(system=words(40), tenant="t", policy="drop", offload="always")
    s1 = tool_turn(rt, x)
    common = words(40, "common")
    rt.send_tool_results(x, [{"tool_call_id": s1.tool_calls[0]["id"], "content": common + " xx"}],
                         forced={"reasoning": words(20), "tool_calls": [{"name": "g", "arguments": {}}]})
    assert len(rt.engine.tree.plan_demote(x).nodes) == 2
    y = rt.create_conversation(system=words(40), tenant="t", policy="engine_default", offload="never")
    y1 = tool_turn(rt, y)
    mover = rt.engine.mover
    original = mover.to_host

    def copy_while_another_step_runs(slots, out):
        original(slots, out)
        mover.to_host = original
        # Y's step shares X's tail up to inside its second node: it splits it.
        rt.send_tool_results(y, [{"tool_call_id": y1.tool_calls[0]["id"], "content": common + " yy"}],
                             forced={"content": words(3)})

    mover.to_host = copy_while_another_step_runs
    assert rt.offload.run_due() == 0
    rt.check_integrity()


def test_a_delete_during_a_demotion_leaves_no_host_entry(rt):
    keeper = rt.create_conversation(system=words(40), tenant="t", policy="keep", offload="never")
    rt.send_message(keeper, words(5, "zeta"), forced={"content": words(3)})
    x = rt.create_conversation(system=words(40), tenant="t", policy="drop", offload="always")
    tool_turn(rt, x)
    guard = rt.offload._guard(x, rt.offload.waiting[x][0])  # the worker already read `waiting`
    forget = rt.offload.forget

    def forget_then_worker_demotes(owner):
        forget(owner)
        assert rt.engine.demote(owner, guard) == 0

    rt.offload.forget = forget_then_worker_demotes
    rt.delete_conversation(x)
    rt.offload.forget = forget
    assert rt.engine.host.peek(x) is None and rt.engine.host.used_tokens == 0
    rt.check_integrity()


def test_a_prefix_shared_from_the_host_is_device_reuse_for_its_owner_after(rt):
    a = rt.create_conversation(system=words(40), tenant="t", policy="drop", offload="always")
    sa = tool_turn(rt, a, reasoning=60)
    moved = rt.offload.run_due()
    assert moved > 0
    b = rt.create_conversation(system=words(40), tenant="t", policy="drop", offload="never")
    sb = tool_turn(rt, b, reasoning=60)  # the same tokens: a's tail is reloaded for both, not prefilled again
    assert sb.accounting.host_loaded_tokens > 0 and rt.engine.host.peek(a).on_device
    ra = rt.send_tool_results(a, [{"tool_call_id": sa.tool_calls[0]["id"], "content": "ok"}],
                              forced={"tool_calls": [{"name": "f", "arguments": {"x": 2}}]})
    # a's chain came back with the sharing: its next step reuses it from the device.
    assert ra.accounting.host_loaded_tokens == 0
    assert ra.accounting.cached_input_tokens == moved
    rt.check_integrity()


def test_a_closing_step_reports_the_chain_it_leaves(rt):
    x = rt.create_conversation(system=words(40), policy="drop", materialize="never", offload="always")
    s1 = tool_turn(rt, x, reasoning=100)
    rt.offload.run_due()
    s2 = rt.send_tool_results(x, [{"tool_call_id": s1.tool_calls[0]["id"], "content": "ok"}],
                              forced={"reasoning": words(100), "content": words(5)})
    chain = rt.describe(x)["chain"]
    assert s2.accounting.kv_device_bytes == chain["kv_device_bytes"]
    assert s2.accounting.kv_host_bytes == chain["kv_host_bytes"] == 0


def test_auto_materialization_waits_while_another_request_is_queued(rt):
    x = rt.create_conversation(system=words(40), policy="drop", materialize="auto")
    rt.materializer.user_enter()  # another request waits for the engine
    try:
        rt.send_message(x, words(5), forced={"reasoning": words(100), "content": words(5)})
    finally:
        rt.materializer.user_exit()
    assert rt.describe(x)["turns"][0]["materialize"] == "skipped: engine busy"


def test_a_replace_that_fails_puts_the_conversation_back(rt):
    """chat_step with replace: the client's history is adopted under the lock,
    and a step that fails puts back what was there, in memory and in the store."""
    from session_runtime import ContextTooLong
    from session_runtime.continuation import split

    c = rt.create_conversation(system="s", policy="drop")
    rt.send_message(c, "hello", forced={"content": "hi"})
    before = rt.describe(c, tokens=True)
    request = split([{"role": "system", "content": "other"}, {"role": "user", "content": "x"},
                     {"role": "assistant", "content": "y"}, {"role": "user", "content": words(3000)}], None)
    with pytest.raises(ContextTooLong):
        rt.chat_step(c, request, replace=True, max_tokens=2)
    assert rt.describe(c, tokens=True) == before
    assert rt.get(c).version == 1


def test_a_second_demotion_never_replaces_a_host_only_copy(rt):
    keeper = rt.create_conversation(system=words(40), tenant="t", policy="keep", offload="never")
    rt.send_message(keeper, words(5, "zeta"), forced={"content": words(3)})
    x = rt.create_conversation(system=words(40), tenant="t", policy="drop", offload="never")
    s = tool_turn(rt, x)
    eng = rt.engine
    first = eng.demote(x)
    assert first > 0
    rt.delete_conversation(keeper)
    with eng.lock:
        eng.tree.evict_tokens(10**6)
    assert eng.demote(x) == 0  # the anchor is exclusive now, but the tail is already on the host
    r = rt.send_tool_results(x, [{"tool_call_id": s.tool_calls[0]["id"], "content": "ok"}], forced={"content": words(2)})
    assert r.accounting.host_loaded_tokens == first  # the first copy comes back whole
    assert eng.host.stats.lost_tokens == 0
    rt.check_integrity()


def test_a_rejected_request_keeps_the_tool_wait_and_the_pending_branch(rt):
    from session_runtime import ContextTooLong

    x = rt.create_conversation(system=words(40), policy="drop", materialize="always", offload="ttl")
    s = tool_turn(rt, x)
    since = rt.offload.waiting[x][0]
    with pytest.raises(ContextTooLong):
        rt.send_tool_results(x, [{"tool_call_id": s.tool_calls[0]["id"], "content": words(3000)}])
    assert rt.offload.waiting[x][0] == since  # the ttl still counts from the tool call
    rt.send_tool_results(x, [{"tool_call_id": s.tool_calls[0]["id"], "content": "ok"}],
                         forced={"reasoning": words(50), "content": words(3)})
    assert rt.materializer.jobs[x].state == "pending"
    with pytest.raises(ContextTooLong):
        rt.send_message(x, words(3000))
    assert rt.materializer.jobs[x].state == "pending"  # cancelled by the claim, scheduled again
    assert rt.materializer.run_pending() == 1
    rt.check_integrity()


class _Recorder:
    """The backend's step, as the materializer's worker calls it: records who ran."""

    def __init__(self):
        self.ran = threading.Event()

    def step(self, request):
        from types import SimpleNamespace

        self.ran.set()
        return SimpleNamespace(accounting=SimpleNamespace(uncached_prefill_tokens=0))


def test_the_materializer_wakes_after_a_user_step_only_for_work():
    """A job queued behind a user step is woken for as that step ends (not left
    to the worker's half-second poll); a user step with no job queued wakes
    nobody (a wake-up is a GIL hand-off, on every step)."""
    from radix_ext.tree import Namespace
    from session_runtime.materializer import Materializer

    backend = _Recorder()
    m = Materializer(backend)
    try:
        wakes = []
        notify = m.cond.notify_all
        m.cond.notify_all = lambda: (wakes.append(1), notify())
        for _ in range(20):
            m.user_enter()
            m.user_exit()
        assert wakes == []
        m.user_enter()
        m.submit("c", [1, 2, 3], Namespace())
        assert wakes == [1]
        time.sleep(0.1)
        assert not backend.ran.is_set()  # a user step is in: the job waits
        m.user_exit()
        assert wakes == [1, 1]
        assert backend.ran.wait(5)
        assert m.wait_idle(5)
    finally:
        m.close()
