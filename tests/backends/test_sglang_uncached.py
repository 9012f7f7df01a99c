"""Every uncached prompt token has a reason on SGLang's real server (the
session's shared server, pool 2048, page 16): a dropped turn without and with
its canonical branch, a chain evicted by a flood of unrelated requests, a tool
wait whose offload policy discards, and a chat client's other history. The
reasons always sum to `uncached_prefill_tokens`. A worker lost or drained
(`backend_lost`) is tested in test_sglang_workers.py."""

from __future__ import annotations

import httpx
import pytest

from tests.session_runtime.test_uncached import another_history, reasons

FORCED = {"reasoning": "Let me think about this. " * 4, "content": "The answer is forty-two."}


@pytest.fixture
def rt(sglang_rt):
    return sglang_rt


def converse(rt, name, **kw):
    cid = rt.create_conversation(system=f"Reasons on SGLang, {name}: every token has one. " * 3, **kw)
    return cid, rt.send_message(cid, "First question.", forced=FORCED)


def test_a_dropped_turn_prefills_its_answer_as_policy_fork(rt):
    cid, first = converse(rt, "fork", policy="drop")
    assert set(reasons(first)) == {"new_input", "first_seen"}
    fork = rt.describe(cid)["turns"][0]["fork_tokens"]
    second = rt.send_message(cid, "Second question.", forced=FORCED)
    out = reasons(second)
    assert set(out) == {"new_input", "policy_fork"}
    conv = rt.get(cid)
    history = len(rt.template(conv.template).render(conv.system, conv.tools, conv.history[:2],
                                                    conv.policy.kept_turns(1), False).ids)
    assert out["policy_fork"] == history - fork  # the answer and its markup, from the fork on


def test_with_the_canonical_branch_only_the_new_input_is_prefilled(rt):
    cid, _ = converse(rt, "canonical", policy="drop", materialize="always")
    rt.materializer.run_pending()
    second = rt.send_message(cid, "Second question.", forced=FORCED)
    assert second.accounting.cache_state == "canonical_branch"
    assert set(reasons(second)) == {"new_input"}


def test_a_chain_evicted_by_other_requests_is_evicted(rt):
    cid, _ = converse(rt, "evicted", policy="keep")
    computed = len(rt.get(cid).chain_tokens)
    rt.backend.release(cid)  # its pages go to SGLang's LRU
    for i in range(20):  # 4000 tokens through the 2048-token pool
        r = httpx.post(f"{rt.backend.url}/generate", timeout=300, json={
            "input_ids": [20000 + 300 * i + j for j in range(200)], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
    second = rt.send_message(cid, "Second question.", forced=FORCED)
    out = reasons(second)
    assert second.accounting.cached_input_tokens == 0
    assert out == {"new_input": second.accounting.prompt_tokens - computed, "evicted": computed}


def test_a_tool_wait_that_discards_is_discarded(rt):
    cid = rt.create_conversation(system="Reasons on SGLang: a discarded tool wait. " * 3, policy="drop",
                                 offload="discard")
    step = rt.send_message(cid, "Use the tool.", forced={"reasoning": "I need a tool. " * 6,
                                                         "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
    assert rt.offload.run_due() > 0
    nxt = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}], forced=FORCED)
    out = reasons(nxt)
    assert set(out) == {"new_input", "discarded"}


def test_a_chat_clients_other_history_is_history_replaced(rt):
    cid, _ = converse(rt, "replaced", policy="drop")
    step = rt.chat_step(cid, another_history(rt, cid), replace=True, forced={"content": "ok"})
    assert set(reasons(step)) == {"new_input", "history_replaced"}
    assert step.accounting.cached_input_tokens > 0  # the system prompt it shares
