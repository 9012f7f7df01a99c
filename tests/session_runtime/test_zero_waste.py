"""Zero-waste KV on the embedded engine: idle chains retired instead of starving
the pool, the generated branch freed at the fork, tool chains that recompute
nothing at page size 16, and every reuse path equal to a cold prefill."""

from __future__ import annotations

import time

import pytest
import torch

from radix_ext.tree import Namespace
from session_runtime import PoolExhausted, Runtime, RuntimeConfig
from session_runtime.backends.base import StepRequest
from session_runtime.sampling import SamplingParams

PAGE = 16
REL_TOL = 1e-4


def words(n: int, word: str = "alpha") -> str:
    return f" {word}" * n


def make(pool_tokens=2048, host=0, idle_ttl_s=0.0, **kw) -> Runtime:
    return Runtime(RuntimeConfig(model="tiny", page_size=PAGE, pool_tokens=pool_tokens, host_pool_tokens=host,
                                 max_context=4096, idle_ttl_s=idle_ttl_s, **kw), background=False)


def closed_turn(rt, system: str, **kw):
    cid = rt.create_conversation(system=system, policy="drop", materialize="never", **kw)
    step = rt.send_message(cid, words(5, "hi"), forced={"reasoning": words(30, "think"), "content": words(8, "ok")})
    return cid, step


def acc_adds_up(acc) -> None:
    assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens


def test_idle_conversations_no_longer_starve_new_ones():
    """Three idle conversations with one turn each hold about 1,900 of 2,048
    pool tokens; a fourth conversation, and their own next turns, still run."""
    rt = make(pool_tokens=2048, host=0)
    try:
        cids = [closed_turn(rt, words(600, w))[0] for w in ("red", "green", "blue")]
        held = sum(rt.engine.tree.chain_tokens(c) for c in cids)
        assert held > 1800 and rt.engine.tree.protected_size() + rt.engine.tree.private_tokens() > 1800
        cid, step = closed_turn(rt, words(600, "gold"))  # would be a 507 with the idle chains locked
        acc_adds_up(step.accounting)
        assert rt.offload.stats["idle_released"] >= 1
        for c in cids:  # their own next turns too: rebuilt by prefill, and counted
            acc = rt.send_message(c, words(3, "again"), max_tokens=2).accounting
            acc_adds_up(acc)
        rt.check_integrity()
    finally:
        rt.close()


def test_a_prompt_that_can_never_fit_is_still_refused():
    """...and it moves no idle chain off the device on its way out."""
    rt = make(pool_tokens=1024, host=1024)
    try:
        cid, _ = closed_turn(rt, words(300, "red"))
        held = rt.engine.tree.chain_tokens(cid)
        with pytest.raises(PoolExhausted):
            closed_turn(rt, words(1500, "huge"))
        assert rt.engine.tree.chain_tokens(cid) == held and rt.engine.host.used_tokens == 0
        assert rt.offload.stats == {"idle_demoted": 0, "idle_released": 0}
        rt.check_integrity()
    finally:
        rt.close()


def test_idle_ttl_demotes_to_the_host_and_the_next_turn_reloads_exactly():
    rt = make(pool_tokens=4096, host=4096, idle_ttl_s=0.5)
    twin = make(pool_tokens=4096, host=4096, idle_ttl_s=0.0)
    try:
        cid, _ = closed_turn(rt, words(100, "red"))
        ref, _ = closed_turn(twin, words(100, "red"))
        before = rt.engine.tree.chain_tokens(cid)
        assert rt.offload.run_due(now=time.monotonic()) == 0  # not idle long enough yet
        moved = rt.offload.run_due(now=time.monotonic() + 1.0)
        assert moved > 0 and rt.engine.host.bytes_of(cid) > 0
        assert rt.engine.tree.chain_tokens(cid) == before - moved and rt.offload.stats["idle_demoted"] == 1
        rt.check_integrity()
        got = rt.send_message(cid, words(3, "again"), max_tokens=3, logprobs=True)
        want = twin.send_message(ref, words(3, "again"), max_tokens=3, logprobs=True)
        acc = got.accounting
        acc_adds_up(acc)
        assert acc.host_loaded_tokens == moved and acc.alignment_loss_tokens == 0
        assert acc.cached_input_tokens + acc.host_loaded_tokens == want.accounting.cached_input_tokens
        assert got.output_ids == want.output_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        rt.check_integrity()
    finally:
        rt.close()
        twin.close()


def test_the_generated_branch_is_freed_at_the_fork():
    rt = make(pool_tokens=4096)
    try:
        cid, step = closed_turn(rt, words(40, "red"))
        tree = rt.engine.tree
        fork = rt.get(cid).turns[0].fork_tokens
        assert tree.chain_tokens(cid) == fork  # exact: the fork's partial page copied
        assert tree.evictable_size() == 0  # nothing of P|R|A left to LRU: 0 orphaned bytes
        # The counterfactual still knows what keep would have reused (its shadow).
        nxt = rt.send_message(cid, words(3, "again"), max_tokens=1).accounting
        assert nxt.counterfactual["keep"]["prefill_tokens"] < nxt.counterfactual["keep"]["prompt_tokens"] - fork
        assert nxt.cached_input_tokens == fork and nxt.alignment_loss_tokens == 0
        rt.check_integrity()
    finally:
        rt.close()


def test_engine_default_leaves_the_branch_to_lru():
    rt = make(pool_tokens=4096)
    try:
        cid = rt.create_conversation(system=words(40, "red"), policy="engine_default")
        rt.send_message(cid, words(5, "hi"), forced={"reasoning": words(30, "think"), "content": words(8, "ok")})
        assert rt.engine.tree.evictable_size() > 0 and rt.engine.tree.private_tokens() == 0
        rt.check_integrity()
    finally:
        rt.close()


def test_tool_chain_steps_recompute_nothing_at_page_size_16():
    rt = make(pool_tokens=4096)
    try:
        cid = rt.create_conversation(system=words(37, "red"), policy="drop", offload="never")
        step = rt.send_message(cid, words(5, "hi"), forced={"reasoning": words(11, "think"),
                                                            "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
        for i in range(4):
            prev = step.accounting
            step = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": words(i + 2, "r")}],
                                        forced={"reasoning": words(3 + i, "think"),
                                                "tool_calls": [{"name": "f", "arguments": {"x": i}}]})
            acc = step.accounting
            assert acc.cached_input_tokens == prev.prompt_tokens + prev.output_tokens, i
            assert acc.recomputed_history_tokens == 0 and acc.alignment_loss_tokens == 0
        rt.check_integrity()
    finally:
        rt.close()


@pytest.mark.parametrize("path", ["private_page", "fork_copy", "host_reload", "canonical_branch"])
def test_every_reuse_path_equals_a_cold_prefill(path):
    """Logits of the continuation after each reuse path against the same tokens
    prefilled cold, float32."""
    rt = make(pool_tokens=4096, host=4096)
    eng = rt.engine
    ns = Namespace(extra_key=f"exact-{path}")
    gen = torch.Generator().manual_seed(3)
    p, r, a, u = (torch.randint(100, 5000, (n,), generator=gen).tolist() for n in (37, 21, 9, 6))

    def step(owner, prompt, forced=None, logits=True, namespace=ns):
        return eng.step(StepRequest(owner=owner, prompt=prompt, namespace=namespace, forced=forced,
                                    sampling=SamplingParams(max_tokens=0 if forced is not None else 1),
                                    return_logits=logits))

    try:
        if path == "private_page":
            step("c", p, forced=r)  # 58 tokens: 3 pages in the tree, 10 private
            assert eng.tree.chain_tokens("c") == len(p) + len(r)
            seq, res = p + r + u, step("c", p + r + u)
            assert res.accounting.cached_input_tokens == len(p) + len(r)
        elif path == "fork_copy":
            step("c", p, forced=r + a)
            eng.lock_prefix("c", ns, p, free_branch=True)  # fork at 37: 32 + 5 copied
            assert eng.tree.chain_tokens("c") == len(p)
            seq, res = p + a + u, step("c", p + a + u)
            assert res.accounting.cached_input_tokens == len(p)
        elif path == "host_reload":
            step("c", p, forced=r)
            assert eng.demote("c") == len(p) + len(r)  # the private page goes to the host too
            eng.reload("c", ns, p + r + u)
            seq, res = p + r + u, step("c", p + r + u)
            assert res.accounting.host_loaded_tokens == len(p) + len(r)
        else:
            step("c", p, forced=r + a)
            eng.lock_prefix("c", ns, p, free_branch=True)
            step("c", p + a, forced=[], logits=False)  # the canonical branch P|A, in idle time
            seq, res = p + a + u, step("c", p + a + u)
            assert res.accounting.cached_input_tokens == len(p) + len(a)
        acc = res.accounting
        assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == len(seq)
        cold = step("cold", seq, namespace=Namespace(extra_key=f"cold-{path}"))
        assert cold.accounting.cached_input_tokens == 0
        n = acc.uncached_prefill_tokens
        err = (res.logits - cold.logits[-n:]).norm() / cold.logits[-n:].norm()
        assert err < REL_TOL, err
        eng.release("cold")
        eng.check_integrity()
    finally:
        rt.close()


def test_a_prefix_on_the_host_is_shared_not_prefilled_again():
    """A's chain waits for a tool on the host tier; B with the same system prompt
    reloads it (A's chain moves back to it, write-through) instead of
    prefilling it twice, and the accounting says so. B's logprobs equal a
    twin's that never offloaded anything."""
    rt, twin = make(pool_tokens=4096, host=4096), make(pool_tokens=4096, host=4096)
    system = words(120, "shared")
    tool = {"reasoning": words(10, "think"), "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    try:
        a = {}
        for r in (rt, twin):
            a[r] = r.create_conversation(system=system, policy="drop", offload="always" if r is rt else "never")
            r.send_message(a[r], words(5, "hi"), forced=tool)
        a = a[rt]
        moved = rt.offload.run_due()
        assert moved > 0 and rt.engine.tree.chain_tokens(a) == 0
        got, want = ({"b": r.create_conversation(system=system, policy="drop")} for r in (rt, twin))
        s_got = rt.send_message(got["b"], words(4, "other"), forced={"content": words(3, "ok")}, logprobs=True)
        s_want = twin.send_message(want["b"], words(4, "other"), forced={"content": words(3, "ok")}, logprobs=True)
        acc, ref = s_got.accounting, s_want.accounting
        # A's whole tail came back; B reused the part its prompt shares.
        assert acc.host_loaded_tokens > 0 and rt.engine.host.stats.shared_tokens == moved
        assert acc.cached_input_tokens + acc.host_loaded_tokens == ref.cached_input_tokens > 0
        assert acc.uncached_prefill_tokens == ref.uncached_prefill_tokens
        assert s_got.logprobs == pytest.approx(s_want.logprobs, abs=1e-4)
        # A's own tail is back on the device (its host copy kept): its next step reloads nothing.
        assert rt.engine.host.peek(a).on_device
        rt.check_integrity()
    finally:
        rt.close()
        twin.close()
