"""Zero-waste KV inside SGLang's scheduler: a conversation's private partial
last page is reused by its next request (0 tokens recomputed at page 16), a
fork inside a page is copied, the generated branch is freed at the fork, and
the canonical branch (a low-priority prefill-only request) is reused. Each
path's logprobs equal transformers' teacher-forced ones in float32."""

from __future__ import annotations

import pytest
import torch

from radix_ext.tree import Namespace
from session_runtime.backends.base import StepRequest
from session_runtime.sampling import SamplingParams
from tests.backends.test_sglang_oracle import _forced_logprobs, hf  # noqa: F401  (module fixture)

PAGE = 16


def _step(backend, owner, prompt, ns, forced):
    return backend.step(StepRequest(owner=owner, prompt=prompt, namespace=ns, forced=forced,
                                    sampling=SamplingParams(max_tokens=0, logprobs=True)))


def _tokens(seed: int, *sizes: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 120000, (n,), generator=gen).tolist() for n in sizes]


def test_own_continuation_reuses_the_private_page(sglang_runtime, hf):  # noqa: F811
    backend = sglang_runtime.backend
    ns = Namespace(extra_key="zw-private")
    p, r, u, out = _tokens(11, 35, 6, 5, 4)
    try:
        _step(backend, "zw-a", p, ns, r)
        assert backend.chain_tokens("zw-a") == 41  # 2 pages in the tree, 9 tokens private
        assert backend.pools()["private"] >= PAGE
        backend.check_integrity()
        second = _step(backend, "zw-a", p + r + u, ns, out)
        acc = second.accounting
        assert (acc.cached_input_tokens, acc.uncached_prefill_tokens, acc.alignment_loss_tokens) == (41, 5, 0)
        assert second.logprobs == pytest.approx(_forced_logprobs(hf, p + r + u, out), abs=2e-3)
        # Another conversation with the same 46-token prompt reuses whole pages
        # only (the last prompt token is always computed: 2 pages of 45).
        other = _step(backend, "zw-b", p + r + u, ns, out)
        assert other.accounting.cached_input_tokens == 32
    finally:
        backend.release("zw-a")
        backend.release("zw-b")
    sglang_runtime.check_integrity()


def test_fork_copy_frees_the_branch_and_is_exact(sglang_runtime, hf):  # noqa: F811
    backend = sglang_runtime.backend
    ns = Namespace(extra_key="zw-fork")
    p, r, a, u, out = _tokens(12, 37, 20, 9, 4, 3)
    try:
        _step(backend, "zw-f", p, ns, r + a)
        assert backend.lock_prefix("zw-f", ns, p, free_branch=True) == 37  # 32 in the tree + 5 copied
        # Nothing past the fork's pages is cached any more: the branch was freed.
        assert backend.probe(ns, p + r + a + [1]).device_len == 32
        backend.check_integrity()
        third = _step(backend, "zw-f", p + a + u, ns, out)
        assert third.accounting.cached_input_tokens == 37
        assert third.logprobs == pytest.approx(_forced_logprobs(hf, p + a + u, out), abs=2e-3)
    finally:
        backend.release("zw-f")
    sglang_runtime.check_integrity()


@pytest.mark.parametrize("order", ["branch_first", "user_first"])
def test_canonical_branch_orders(sglang_runtime, order):
    """The canonical branch runs as a background (low priority) prefill-only
    request. Built before the next user message, that message prefills only its
    own tokens; a user message that comes first cancels it and prefills lazily:
    no double work either way."""
    rt = sglang_runtime
    cid = rt.create_conversation(system="Canonical branch on SGLang. " * 6, policy="drop", materialize="always",
                                 tenant=f"zw-{order}")
    try:
        rt.send_message(cid, "Solve it.", forced={"reasoning": "Let me think. " * 12, "content": "It is 42."})
        turn = rt.get(cid).turns[0]
        assert turn.materialize.startswith("scheduled")
        assert rt.backend.chain_tokens(cid) == turn.fork_tokens  # the fork, exactly
        before = dict(rt.materializer.stats)
        if order == "branch_first":
            assert rt.materializer.run_pending() == 1
        step = rt.send_message(cid, "And then?", forced={"content": "Done."})
        acc = step.accounting
        new_tokens = acc.prompt_tokens - rt.get(cid).turns[0].steps[-1].active_context_length
        if order == "branch_first":
            assert acc.cache_state == "canonical_branch"
            assert acc.uncached_prefill_tokens == new_tokens  # |U| plus the template's tokens
            assert rt.materializer.stats["done"] == before["done"] + 1
        else:
            assert rt.materializer.stats["cancelled"] == before["cancelled"] + 1
            assert acc.cached_input_tokens == turn.fork_tokens  # prefilled lazily from the fork
        assert acc.cached_input_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
    finally:
        rt.delete_conversation(cid)
    rt.check_integrity()


def test_tool_wait_offload_in_the_scheduler_is_exact(sglang_runtime):
    """During a tool wait the conversation's exclusive tail moves from the
    scheduler's KV pool to its host tier and its pages are freed; the next
    step promotes it first, counts it as host_loaded, and computes the same
    logprobs as a twin conversation whose KV never left."""
    rt = sglang_runtime
    system = "Offload inside the scheduler. " * 10
    forced1 = {"reasoning": "I need a tool. " * 6, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    forced2 = {"reasoning": "Got it.", "content": "The answer is 42."}
    moved_cid = rt.create_conversation(system=system, policy="drop", offload="always", tenant="zw-offload")
    twin_cid = rt.create_conversation(system=system, policy="drop", offload="never", tenant="zw-twin")
    try:
        steps = {c: rt.send_message(c, "Use the tool.", forced=forced1) for c in (moved_cid, twin_cid)}
        before = rt.backend.chain_tokens(moved_cid)
        moved = rt.offload.run_due()
        assert moved > 0 and rt.backend.chain_tokens(moved_cid) == before - moved
        assert rt.backend.host_bytes(moved_cid) == moved * rt.backend.bytes_per_token
        rt.backend.check_integrity()
        got = {c: rt.send_tool_results(c, [{"tool_call_id": steps[c].tool_calls[0]["id"], "content": "ok"}],
                                       forced=forced2, logprobs=True) for c in (moved_cid, twin_cid)}
        acc, ref = got[moved_cid].accounting, got[twin_cid].accounting
        assert acc.host_loaded_tokens == moved
        assert acc.cached_input_tokens + acc.host_loaded_tokens == ref.cached_input_tokens
        assert ref.uncached_prefill_tokens == acc.uncached_prefill_tokens  # the tool result and template only
        assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
        assert got[moved_cid].logprobs == pytest.approx(got[twin_cid].logprobs, abs=1e-3)
        assert rt.backend.host_bytes(moved_cid) == 0
    finally:
        rt.delete_conversation(moved_cid)
        rt.delete_conversation(twin_cid)
    rt.check_integrity()


def test_a_prefix_on_the_scheduler_host_tier_is_shared_not_prefilled_again(sglang_runtime):
    """A waits for a tool with its chain in the scheduler's host tier; B, with
    the same system prompt, has A's copy promoted back under A's chain and
    reuses it from the tree instead of prefilling it twice: the accounting
    counts it as host_loaded, and B computes what a twin pair that never
    offloaded computes. A's own next step then reloads nothing."""
    rt = sglang_runtime
    system = "Sharing the host tier between conversations. " * 12
    tool = {"reasoning": "A tool first. " * 4, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    answer = {"content": "Fine."}
    cids = {}
    try:
        for tenant, offload in (("zw-share", "always"), ("zw-share-twin", "never")):
            cids[tenant] = rt.create_conversation(system=system, policy="drop", offload=offload, tenant=tenant)
        calls = {t: rt.send_message(c, "Use the tool.", forced=tool).tool_calls for t, c in cids.items()}
        a = cids["zw-share"]
        held = rt.backend.chain_tokens(a)
        moved = rt.offload.run_due()
        assert moved > 0 and rt.backend.chain_tokens(a) == held - moved
        shared_before = rt.backend.pools()["host"].get("shared_tokens", 0)
        for tenant in list(cids):
            cids[tenant + "/b"] = rt.create_conversation(system=system, policy="drop", tenant=tenant)
        got, ref = (rt.send_message(cids[t + "/b"], "Something else.", forced=answer, logprobs=True)
                    for t in ("zw-share", "zw-share-twin"))
        acc = got.accounting
        assert acc.host_loaded_tokens > 0
        assert rt.backend.pools()["host"]["shared_tokens"] - shared_before == acc.host_loaded_tokens
        assert acc.cached_input_tokens + acc.host_loaded_tokens == ref.accounting.cached_input_tokens
        assert acc.uncached_prefill_tokens == ref.accounting.uncached_prefill_tokens
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-3)
        assert rt.backend.chain_tokens(a) == held and rt.backend.host_bytes(a) == 0  # moved back, not copied
        rt.backend.check_integrity()
        after = {t: rt.send_tool_results(cids[t], [{"tool_call_id": calls[t][0]["id"], "content": "ok"}],
                                         forced=answer).accounting for t in ("zw-share", "zw-share-twin")}
        assert after["zw-share"].host_loaded_tokens == 0
        assert after["zw-share"].cached_input_tokens == after["zw-share-twin"].cached_input_tokens
    finally:
        for cid in cids.values():
            rt.delete_conversation(cid)
    rt.check_integrity()


def test_idle_chains_do_not_starve_a_new_conversation(sglang_runtime):
    """Pool 2048: three idle conversations hold about 1,900 tokens of it. SGLang
    would queue a fourth conversation forever behind their locks; the
    scheduler retires idle chains, oldest first (to its host tier), so it is
    admitted."""
    import threading

    rt = sglang_runtime
    forced = {"reasoning": "Thinking. " * 4, "content": "Done."}
    cids = [rt.create_conversation(system=f" {w}" * 620, policy="drop", materialize="never", tenant="zw-idle")
            for w in ("red", "green", "blue", "gold")]
    try:
        for cid in cids[:3]:
            rt.send_message(cid, "Hi", forced=forced)
        held = sum(rt.backend.chain_lengths().get(c, 0) for c in cids[:3])
        assert held > 1800
        done: list = []
        worker = threading.Thread(target=lambda: done.append(rt.send_message(cids[3], "Hi", forced=forced)))
        worker.start()
        worker.join(timeout=240)
        assert done, "the new conversation was never admitted"
        acc = done[0].accounting
        assert acc.cached_input_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
        stats = rt.backend.pools()["idle_stats"]
        assert stats["pressure_demoted"] >= 1  # to the scheduler's host tier, which has room
        # The retired conversation's next turn reloads it, and counts it.
        acc = rt.send_message(cids[0], "Again", forced=forced).accounting
        assert acc.host_loaded_tokens > 0
        assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
    finally:
        for cid in cids:
            rt.delete_conversation(cid)
    rt.check_integrity()
