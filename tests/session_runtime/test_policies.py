"""The seed's keep/drop cost table, reproduced through the runtime (scaled to
CPU: P, R, A, U = 2000, 400, 30, 10 tokens of forced output, page size 1),
plus page alignment at page size 16, the splice counter-example and the
materialization races."""

from __future__ import annotations

import threading

import pytest
import torch

from session_runtime import Runtime, RuntimeConfig

P, R, A, U = 2000, 400, 30, 10


def words(n: int) -> str:
    return " alpha" * n  # one token per word in the DeepSeek tokenizer


# bos + system + <User> U <Assistant> <think> is exactly P tokens; the fork sits
# before <think> (a dropped turn renders </think> there instead).
SYSTEM = words(P - U - 4)
FORK = P - 1


@pytest.fixture(scope="module")
def rt():
    runtime = Runtime(RuntimeConfig(model="tiny", page_size=1, pool_tokens=32768, max_context=8192), background=False)
    yield runtime
    runtime.close()


def play(rt: Runtime, tenant: str, policy: str, materialize: str = "never"):
    """Turn 1 with forced R and A, then turn 2's user message. Returns both steps."""
    # The tenant salts the cache namespace: scenarios never share hits.
    cid = rt.create_conversation(system=SYSTEM, tenant=tenant, policy=policy, materialize=materialize)
    first = rt.send_message(cid, words(U), forced={"reasoning": words(R), "content": words(A)})
    rt.materializer.run_pending()
    second = rt.send_message(cid, words(U), forced={"reasoning": words(4), "content": words(2)})
    rt.check_integrity()
    return cid, first, second


def test_prompt_layout(rt):
    cid = rt.create_conversation(system=SYSTEM, tenant="layout")
    step = rt.send_message(cid, words(U), max_tokens=1)
    assert step.accounting.prompt_tokens == P
    assert step.accounting.cache_state == "none"


def test_keep_prefills_only_the_new_message(rt):
    cid, first, second = play(rt, "keep", "keep")
    assert first.accounting.uncached_prefill_tokens == P
    # <User> U <Assistant> <think>: |U| plus three template tokens.
    assert second.accounting.uncached_prefill_tokens == U + 3
    assert second.accounting.cache_state == "generated_branch"
    assert second.accounting.recomputed_history_tokens == 0


def test_drop_without_materialization_prefills_the_answer_again(rt):
    cid, first, second = play(rt, "drop-lazy", "drop", "never")
    # </think> A <eos> after the fork, then <User> U <Assistant> <think>.
    assert second.accounting.uncached_prefill_tokens == A + U + 5
    assert second.accounting.recomputed_history_tokens == A + 2
    assert second.accounting.cached_input_tokens == FORK
    assert second.accounting.cache_state == "prefix_only"
    turn = rt.describe(cid)["turns"][0]
    assert turn["fork_tokens"] == FORK
    assert turn["materialize"] is None or turn["materialize"].startswith("skipped")


def test_drop_with_materialization_prefills_only_the_new_message(rt):
    cid, first, second = play(rt, "drop-mat", "drop", "always")
    assert second.accounting.uncached_prefill_tokens == U + 3
    assert second.accounting.cache_state == "canonical_branch"
    # The answer was paid for in idle time instead: </think> A <eos>.
    assert rt.describe(cid)["turns"][0]["materialized_prefill_tokens"] == A + 2
    # The next context is shorter by the reasoning (and its <think> marker).
    assert first.accounting.active_context_length == FORK + 1 + A + 1


def test_counterfactuals_agree_with_the_other_policy(rt):
    _, _, keep2 = play(rt, "cf-keep", "keep")
    _, _, drop2 = play(rt, "cf-drop", "drop", "never")
    assert keep2.accounting.counterfactual["drop"]["prefill_tokens"] == drop2.accounting.uncached_prefill_tokens
    assert drop2.accounting.counterfactual["keep"]["prefill_tokens"] == keep2.accounting.uncached_prefill_tokens
    assert keep2.accounting.counterfactual["keep"]["prefill_tokens"] == keep2.accounting.uncached_prefill_tokens
    assert drop2.accounting.counterfactual["drop"]["prompt_tokens"] == drop2.accounting.prompt_tokens
    assert keep2.accounting.counterfactual["keep"]["prompt_tokens"] - drop2.accounting.prompt_tokens == R + 1 + 1 - 1


def test_materialization_cancelled_by_an_early_message(rt):
    """Order 1: the message arrives before the job starts: the job is cancelled
    and the step prefills lazily, so nothing is computed twice."""
    before = dict(rt.materializer.stats)
    cid = rt.create_conversation(system=SYSTEM, tenant="race-cancel", policy="drop", materialize="always")
    rt.send_message(cid, words(U), forced={"reasoning": words(R), "content": words(A)})
    assert rt.materializer.jobs[cid].state == "pending"
    second = rt.send_message(cid, words(U), max_tokens=1)
    assert rt.materializer.stats["cancelled"] == before["cancelled"] + 1
    assert rt.materializer.stats["prefill_tokens"] == before["prefill_tokens"]
    assert second.accounting.uncached_prefill_tokens == A + U + 5
    # Turn 2 closed too and scheduled its own canonical branch.
    assert rt.materializer.run_pending() == 1
    rt.check_integrity()


def test_materialization_joined_by_a_message_in_flight(rt):
    """Order 2: the job is running when the message arrives: the step waits for
    it and reuses its pages; job plus step compute what a lazy step would."""
    before = dict(rt.materializer.stats)
    cid = rt.create_conversation(system=SYSTEM, tenant="race-join", policy="drop", materialize="always")
    rt.send_message(cid, words(U), forced={"reasoning": words(R), "content": words(A)})
    started, release = threading.Event(), threading.Event()

    def hold(job):
        started.set()
        assert release.wait(10), "test never released the job"

    rt.materializer.before_run = hold
    worker = threading.Thread(target=rt.materializer.run_pending)
    worker.start()
    try:
        assert started.wait(10)
        box = {}
        user = threading.Thread(target=lambda: box.update(step=rt.send_message(cid, words(U), max_tokens=1)))
        user.start()
        user.join(0.3)
        assert user.is_alive(), "the message must wait for the running job, not race it"
        release.set()
        user.join(30)
        worker.join(30)
    finally:
        rt.materializer.before_run = None
        release.set()
    step = box["step"]
    assert rt.materializer.stats["joined"] == before["joined"] + 1
    job_prefill = rt.materializer.stats["prefill_tokens"] - before["prefill_tokens"]
    assert job_prefill == A + 2
    assert step.accounting.uncached_prefill_tokens == U + 3
    assert job_prefill + step.accounting.uncached_prefill_tokens == A + U + 5  # = the lazy cost
    assert step.accounting.cache_state == "canonical_branch"
    rt.check_integrity()


def test_baselines(rt):
    # engine_default: the template drops reasoning; nothing is locked between steps.
    cid, _, second = play(rt, "engine-default", "engine_default")
    assert second.accounting.uncached_prefill_tokens == A + U + 5
    assert rt.engine.tree.chain_tokens(cid) == 0
    # strip_thinking_cache: only prompts are cached, tool-chain steps included.
    cid = rt.create_conversation(system=SYSTEM, tenant="strip", policy="strip_thinking_cache")
    s1 = rt.send_message(cid, words(U), forced={"reasoning": words(R), "tool_calls": [{"name": "f", "arguments": {}}]})
    s2 = rt.send_tool_results(cid, [{"tool_call_id": s1.tool_calls[0]["id"], "content": "ok"}],
                              forced={"content": words(A)})
    assert s2.accounting.cached_input_tokens == s1.accounting.prompt_tokens
    assert s2.accounting.recomputed_history_tokens == s1.accounting.output_tokens
    rt.check_integrity()


def test_tool_chain_recomputes_nothing_under_drop(rt):
    cid = rt.create_conversation(system=SYSTEM, tenant="chain", policy="drop", materialize="never")
    s1 = rt.send_message(cid, words(U), forced={"reasoning": words(R), "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
    s2 = rt.send_tool_results(cid, [{"tool_call_id": s1.tool_calls[0]["id"], "content": "ok"}],
                              forced={"reasoning": words(R), "content": words(A)})
    assert s2.accounting.cached_input_tokens == s1.accounting.prompt_tokens + s1.accounting.output_tokens
    assert s2.accounting.recomputed_history_tokens == 0
    rt.check_integrity()


def test_fork_inside_a_page_is_copied_not_recomputed(rt):
    """At page size 16 the fork falls inside a page: its valid head is copied
    into the chain's private page, so the next turn reuses the fork exactly; a
    conversation with the same prompt reuses whole pages only."""
    paged = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=32768, max_context=8192), background=False)
    try:
        cid = paged.create_conversation(system=SYSTEM, policy="drop", materialize="never")
        paged.send_message(cid, words(U), forced={"reasoning": words(R), "content": words(A)})
        assert FORK % 16 and paged.engine.tree.chain_tokens(cid) == FORK
        second = paged.send_message(cid, words(U), max_tokens=1)
        acc = second.accounting
        assert acc.logical_reusable_tokens == acc.cached_input_tokens == FORK
        assert acc.alignment_loss_tokens == 0
        other = paged.create_conversation(system=SYSTEM, policy="drop", materialize="never")
        acc = paged.send_message(other, words(U), max_tokens=1).accounting
        assert acc.cached_input_tokens == (acc.prompt_tokens - 1) // 16 * 16
        paged.check_integrity()
    finally:
        paged.close()


def test_splicing_the_old_answer_is_wrong(rt):
    """A's KV was computed after R: splicing it after P gives other logits than a
    cold prefill of P|A|U; the runtime's own fork path gives the cold logits."""
    from radix_ext.tree import Namespace
    from session_runtime.backends.embedded.engine import StepRequest

    eng = rt.engine
    ns = Namespace(extra_key="splice")
    gen = torch.Generator().manual_seed(7)
    p, r, a, u = (torch.randint(100, 5000, (n,), generator=gen).tolist() for n in (40, 30, 12, 6))
    eng.step(StepRequest(owner="splice-gen", prompt=p + r + a, namespace=ns, forced=[]))
    g_slots = eng.tree.chain_slots("splice-gen")
    canonical = p + a + u
    # The runtime's path: reuse only P, prefill A and U.
    ours = eng.step(StepRequest(owner="splice-ours", prompt=canonical, namespace=ns, forced=[], return_logits=True))
    assert ours.accounting.cached_input_tokens == len(p)
    cold = eng.step(StepRequest(owner="splice-cold", prompt=canonical, namespace=Namespace(extra_key="cold"),
                                forced=[], return_logits=True))
    assert cold.accounting.cached_input_tokens == 0
    tail = len(u)
    torch.testing.assert_close(ours.logits[-tail:], cold.logits[-tail:], rtol=1e-4, atol=1e-4)
    # The splice: P's slots, then A's slots from the generated branch, then U.
    spliced_ctx = torch.cat((g_slots[: len(p)], g_slots[len(p) + len(r) : len(p) + len(r) + len(a)]))
    new = eng.alloc(tail)
    try:
        logits = eng.decoder(torch.tensor(u), torch.arange(len(p) + len(a), len(canonical)), new[:tail],
                             torch.cat((spliced_ctx, new[:tail])), eng.pools.kv, all_logits=True)
    finally:
        eng.pools.allocator.free(new)
    err = (logits - cold.logits[-tail:]).abs().max() / cold.logits[-tail:].abs().max()
    assert err > 1e-2, f"splicing should change the logits, relative error only {err}"
    for owner in ("splice-gen", "splice-ours", "splice-cold"):
        eng.release(owner)
    rt.check_integrity()
