"""Every uncached prompt token has a reason (session_runtime/uncached.py): the
pure attribution, then each reason produced by a real scenario on the embedded
engine (the tiny preset, page 16); the reasons always sum to the step's
`uncached_prefill_tokens`. The SGLang backend's scenarios are in
tests/backends/test_sglang_backend.py."""

from __future__ import annotations

import pytest

from session_runtime import Runtime, RuntimeConfig
from session_runtime.continuation import split
from session_runtime.uncached import REASONS, Known, attribute

FORCED = {"reasoning": " think" * 40, "content": " answer" * 9}


def words(n: int) -> str:
    return " alpha" * n


def reasons(step) -> dict:
    acc = step.accounting
    out = {e["reason"]: e["tokens"] for e in acc.uncached}
    assert sum(out.values()) == acc.uncached_prefill_tokens, (out, acc.uncached_prefill_tokens)
    assert list(out) == [r for r in REASONS if r in out]  # the fixed order, no zeros
    return out


# ----- the attribution itself ---------------------------------------------------


def test_a_new_conversation_is_first_seen_history_and_new_input():
    prompt = list(range(30))
    assert attribute(prompt, 20, 30, 0, Known()) == [
        {"reason": "new_input", "tokens": 10}, {"reason": "first_seen", "tokens": 20}]
    # 16 tokens of its system prompt came from another conversation's page.
    assert attribute(prompt, 20, 14, 3, Known()) == [
        {"reason": "new_input", "tokens": 10}, {"reason": "first_seen", "tokens": 4}]


def test_a_prompt_that_continues_the_whole_sequence_prefills_only_new_input():
    seq = list(range(20))
    prompt = seq + [99] + list(range(100, 109))  # the unfed sampled token, then the tool results
    assert attribute(prompt, 22, 10, 0, Known(sequence=seq, diverged="policy_fork")) == [
        {"reason": "new_input", "tokens": 10}]


def test_a_fork_splits_lost_rewritten_and_new_tokens():
    seq = list(range(40))  # prompt + reasoning + answer as generated
    prompt = list(range(12)) + [500 + i for i in range(18)] + [900, 901, 902]  # 12 shared, then the answer
    known = Known(sequence=seq, diverged="policy_fork", lost="discarded")
    # Reused 5 of the 12 shared: 7 discarded (2 of them also in a page it could
    # not share: discarded comes first).
    assert attribute(prompt, 30, len(prompt) - 5, 2, known) == [
        {"reason": "new_input", "tokens": 3}, {"reason": "policy_fork", "tokens": 18},
        {"reason": "discarded", "tokens": 7}]
    # Lost with a worker: what the new worker holds in an unshareable page is page_alignment.
    moved = Known(sequence=seq, diverged="policy_fork", lost="backend_lost")
    assert attribute(prompt, 30, len(prompt) - 5, 2, moved) == [
        {"reason": "new_input", "tokens": 3}, {"reason": "policy_fork", "tokens": 18},
        {"reason": "page_alignment", "tokens": 2}, {"reason": "backend_lost", "tokens": 5}]
    # A canonical branch computed the whole history: only its loss and the new input.
    assert attribute(prompt, 30, 3, 0, Known(sequence=seq, history_computed=True)) == [
        {"reason": "new_input", "tokens": 3}]


def test_a_baseline_that_never_caches_its_output_pays_it_as_policy():
    seq = list(range(30))  # its prompt was 20 of them
    prompt = seq + [77, 78]
    assert attribute(prompt, 31, 12, 0, Known(sequence=seq, diverged="policy_fork", kept=20)) == [
        {"reason": "new_input", "tokens": 2}, {"reason": "policy_fork", "tokens": 10}]


@pytest.mark.parametrize("reused", range(0, 34, 3))
@pytest.mark.parametrize("history_computed", [False, True])
def test_the_reasons_always_sum_to_the_uncached_tokens(reused, history_computed):
    seq = list(range(25))
    prompt = list(range(15)) + list(range(100, 118))
    for known in (Known(), Known(sequence=seq, diverged="history_replaced", history_computed=history_computed),
                  Known(sequence=seq, kept=10, lost="backend_lost")):
        out = attribute(prompt, 29, len(prompt) - reused, 4, known)
        assert sum(e["tokens"] for e in out) == len(prompt) - reused
        assert all(e["tokens"] > 0 and e["reason"] in REASONS for e in out)


# ----- on the embedded engine --------------------------------------------------


@pytest.fixture(scope="module")
def rt():
    runtime = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=4096, host_pool_tokens=2048,
                                    max_context=2048), background=False)
    yield runtime
    runtime.close()


def converse(rt, tenant, policy="drop", **kw):
    cid = rt.create_conversation(system=words(30), tenant=tenant, policy=policy, **kw)
    return cid, rt.send_message(cid, words(5), forced=FORCED)


def test_a_new_conversation_prefills_first_seen_history_and_its_message(rt):
    cid, first = converse(rt, "uc-first")
    assert first.accounting.uncached_prefill_tokens == first.accounting.prompt_tokens
    conv = rt.get(cid)
    history = len(rt.template(conv.template).render(conv.system, conv.tools, [], lambda t: True, False).ids)
    assert reasons(first) == {"new_input": first.accounting.prompt_tokens - history, "first_seen": history}


def test_a_dropped_turn_without_its_canonical_branch_prefills_the_answer_as_policy_fork(rt):
    cid, first = converse(rt, "uc-fork")
    fork = rt.describe(cid)["turns"][0]["fork_tokens"]
    second = rt.send_message(cid, words(3), forced=FORCED)
    out = reasons(second)
    assert set(out) == {"new_input", "policy_fork"}
    # The answer and the markup around it, from the fork to the history's end.
    conv = rt.get(cid)
    keep = conv.policy.kept_turns(1)
    history = len(rt.template(conv.template).render(conv.system, conv.tools, conv.history[:2], keep, False).ids)
    assert out["policy_fork"] == history - fork
    assert rt.describe(cid)["turns"][1]["totals"]["uncached"] == out


def test_with_its_canonical_branch_only_the_new_input_is_prefilled(rt):
    cid, _ = converse(rt, "uc-canonical", materialize="always")
    rt.materializer.run_pending()
    second = rt.send_message(cid, words(3), forced=FORCED)
    assert second.accounting.cache_state == "canonical_branch"
    assert set(reasons(second)) == {"new_input"}


def test_a_chain_evicted_under_pressure_is_evicted(rt):
    cid, first = converse(rt, "uc-evicted", policy="keep")
    engine = rt.engine
    assert engine.release_idle(cid) > 0
    with engine.lock:
        engine.tree.evict_tokens(engine.tree.evictable_size())
    computed = len(rt.get(cid).chain_tokens)
    second = rt.send_message(cid, words(3), forced=FORCED)
    out = reasons(second)
    assert second.accounting.cached_input_tokens == 0
    assert out == {"new_input": second.accounting.prompt_tokens - computed, "evicted": computed}


def test_a_tool_wait_that_discards_its_kv_is_discarded(rt):
    cid = rt.create_conversation(system=words(30), tenant="uc-discard", policy="drop", offload="discard")
    step = rt.send_message(cid, words(5), forced={"reasoning": words(40),
                                                  "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
    rt.offload.run_due()
    nxt = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                               forced={"reasoning": words(3), "content": words(4)})
    out = reasons(nxt)
    assert set(out) == {"new_input", "discarded"}
    # The whole computed sequence is lost: the step's prompt and its output but the unfed last token.
    assert out["discarded"] + out["new_input"] == nxt.accounting.prompt_tokens


def another_history(rt, cid):
    """A chat request with the conversation's system prompt and another history."""
    return split([{"role": "system", "content": rt.get(cid).system},
                  {"role": "user", "content": "a different first message"},
                  {"role": "assistant", "content": "and answer"},
                  {"role": "user", "content": "go on"}], None)


def test_a_chat_client_with_another_history_is_history_replaced(rt):
    cid, first = converse(rt, "uc-replaced")
    step = rt.chat_step(cid, another_history(rt, cid), replace=True, forced={"content": "ok"})
    out = reasons(step)
    assert set(out) == {"new_input", "history_replaced"}
    # The shared system prompt was reused; everything after it differs.
    assert step.accounting.cached_input_tokens >= 16


def test_a_restarted_runtime_lost_the_kv_with_its_process(tmp_path):
    config = RuntimeConfig(model="tiny", page_size=16, pool_tokens=2048, max_context=1024, data_dir=str(tmp_path))
    first_rt = Runtime(config, background=False)
    try:
        cid, _ = converse(first_rt, "uc-restart", policy="keep")
    finally:
        first_rt.close()
    again = Runtime(config, background=False)
    try:
        step = again.send_message(cid, words(3), forced=FORCED)
        out = reasons(step)
        assert set(out) == {"new_input", "backend_lost"}
    finally:
        again.close()
