"""Tool-wait offload: exactness of the host round trip, the policies, host-tier
loss, and integrity under any interleaving (hypothesis state machine)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from session_runtime import InvalidRequest, PoolExhausted, Runtime, RuntimeConfig


def words(n: int) -> str:
    return " alpha" * n


# A tool_step's chain: its exact computed sequence, 9 tree pages (144) plus 9
# tokens in its private partial last page, all demoted and reloaded together.
CHAIN = 153
PAGE = 16


@pytest.fixture(scope="module")
def rt():
    runtime = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=4096, host_pool_tokens=2048,
                                    max_context=2048), background=False)
    yield runtime
    runtime.close()


def tool_step(rt, tenant, offload="always", reasoning=60):
    cid = rt.create_conversation(system=words(40), tenant=tenant, policy="drop", offload=offload)
    step = rt.send_message(cid, words(5), forced={"reasoning": words(reasoning),
                                                  "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
    return cid, step


def resume(rt, cid, step, **kw):
    return rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                                forced={"reasoning": words(3), "content": words(4)}, **kw)


def pool_kv(rt, slots):
    kv = rt.engine.pools.kv
    return [(kv.k_buffer[i][slots].clone(), kv.v_buffer[i][slots].clone()) for i in range(len(kv.k_buffer))]


def test_round_trip_is_bit_identical(rt):
    cid, step = tool_step(rt, "bits")
    eng = rt.engine
    slots = eng.tree.chain_slots(cid)
    original = pool_kv(rt, slots)
    free_before = eng.pools.allocator.available_size()
    moved = rt.offload.run_due()
    assert moved == len(slots) == CHAIN  # the whole chain is this conversation's alone
    assert eng.tree.chain_tokens(cid) == 0
    # The private partial page goes back whole.
    assert eng.pools.allocator.available_size() == free_before + -(-moved // PAGE) * PAGE
    entry = eng.host.peek(cid)
    host = zip(entry.kv.k, entry.kv.v)
    for (k0, v0), (k1, v1) in zip(original, host):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    snap = {n.residency for n in rt.tree_snapshot(cid)}
    assert snap == {"host"}
    rt.check_integrity()
    # Another tool call keeps the turn open, so the chain still starts with the reloaded KV.
    nxt = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                               forced={"tool_calls": [{"name": "f", "arguments": {"x": 2}}]})
    assert nxt.accounting.host_loaded_tokens == CHAIN
    assert nxt.accounting.cached_input_tokens == 0
    reloaded = pool_kv(rt, eng.tree.chain_slots(cid)[:CHAIN])
    for (k0, v0), (k1, v1) in zip(original, reloaded):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    rt.delete_conversation(cid)
    rt.check_integrity()


def test_logits_equal_a_conversation_that_never_left(rt):
    a, sa = tool_step(rt, "stay", offload="never")
    b, sb = tool_step(rt, "leave", offload="always")
    assert rt.offload.run_due() == CHAIN
    ra = resume(rt, a, sa, logprobs=True)
    rb = resume(rt, b, sb, logprobs=True)
    assert rb.accounting.host_loaded_tokens == CHAIN and ra.accounting.host_loaded_tokens == 0
    assert ra.accounting.cached_input_tokens == CHAIN
    assert ra.accounting.uncached_prefill_tokens == rb.accounting.uncached_prefill_tokens
    torch.testing.assert_close(torch.tensor(rb.logprobs), torch.tensor(ra.logprobs), rtol=1e-5, atol=1e-5)
    rt.check_integrity()


def test_ttl_waits_then_demotes(rt):
    cid, step = tool_step(rt, "ttl", offload="ttl")
    since = rt.offload.waiting[cid][0]
    assert rt.offload.due(now=since + 1.0) == []
    assert rt.offload.due(now=since + 2.5) == [cid]
    assert rt.offload.run_due(now=since + 2.5) == CHAIN
    assert resume(rt, cid, step).accounting.host_loaded_tokens == CHAIN
    rt.check_integrity()


def test_pressure_demotes_waiting_conversations_instead_of_failing():
    small = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=512, host_pool_tokens=2048,
                                  max_context=1024), background=False)
    try:
        waiting, step = tool_step(small, "w", offload="pressure", reasoning=300)
        held = small.engine.tree.chain_tokens(waiting)
        assert held == 393  # exact: 24 tree pages + 9 private tokens
        # A new conversation needs more than is free, and the waiting chain is locked.
        other = small.create_conversation(system=words(40), tenant="o", policy="drop", offload="never")
        got = small.send_message(other, words(5), forced={"reasoning": words(150), "content": words(5)})
        assert got.accounting.uncached_prefill_tokens == got.accounting.prompt_tokens
        assert small.engine.host.peek(waiting) is not None  # demoted, not lost
        back = resume(small, waiting, step)
        assert back.accounting.host_loaded_tokens > 0
        small.check_integrity()
    finally:
        small.close()


def test_host_tier_loss_is_recomputed():
    tiny_host = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=4096, host_pool_tokens=160,
                                      max_context=2048), background=False)
    try:
        a, sa = tool_step(tiny_host, "a")
        assert tiny_host.offload.run_due() == CHAIN
        b, sb = tool_step(tiny_host, "b")
        assert tiny_host.offload.run_due() == CHAIN  # pushes a's copy out: the host holds 160
        assert tiny_host.engine.host.peek(a) is None
        assert tiny_host.engine.host.stats.lost_tokens == CHAIN
        lost = [(n.residency, n.tokens, n.owners) for n in tiny_host.tree_snapshot(a)]
        assert lost == [("evicted", 144, (a,))]  # the tree's nodes: the private tokens are no node
        ra = resume(tiny_host, a, sa)
        assert {n.residency for n in tiny_host.tree_snapshot(a)} == {"device"}  # recomputed
        assert ra.accounting.host_loaded_tokens == 0
        # Everything before the tool results was computed once and lost: recomputed.
        assert ra.accounting.recomputed_history_tokens == sa.accounting.prompt_tokens + sa.accounting.output_tokens
        tiny_host.check_integrity()
    finally:
        tiny_host.close()


class OffloadMachine(RuleBasedStateMachine):
    """Any interleaving of steps, tool waits, demotions, reloads, evictions and
    deletions keeps the pools, locks, chains and host tier consistent."""

    rt: Runtime = None  # set by the test

    def __init__(self):
        super().__init__()
        self.pending: dict[str, str] = {}  # conversation -> pending call id
        self.idle: list[str] = []

    @rule(tools=st.booleans(), r=st.integers(0, 40), offload=st.sampled_from(["never", "always", "pressure"]))
    def open_turn(self, tools, r, offload):
        cid = self.rt.create_conversation(system=words(20), policy="drop", offload=offload)
        forced = {"reasoning": words(r)}
        forced.update({"tool_calls": [{"name": "f", "arguments": {}}]} if tools else {"content": words(3)})
        try:
            step = self.rt.send_message(cid, words(3), forced=forced)
        except PoolExhausted:  # a normal outcome with a full pool: nothing changed
            self.idle.append(cid)
            assert self.rt.describe(cid)["turns"] == []
            return
        (self.pending.__setitem__(cid, step.tool_calls[0]["id"]) if tools else self.idle.append(cid))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def answer(self, data):
        cid = data.draw(st.sampled_from(sorted(self.pending)))
        try:
            self.rt.send_tool_results(cid, [{"tool_call_id": self.pending[cid], "content": "r"}],
                                      forced={"content": words(2)})
        except PoolExhausted:
            assert self.rt.describe(cid)["pending_tool_calls"][0]["id"] == self.pending[cid]
            return
        del self.pending[cid]
        self.idle.append(cid)

    @rule()
    def demote_due(self):
        self.rt.offload.run_due()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def demote_one(self, data):
        self.rt.engine.demote(data.draw(st.sampled_from(sorted(self.pending))))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def discard_one(self, data):
        self.rt.engine.discard(data.draw(st.sampled_from(sorted(self.pending))))

    @rule(n=st.integers(1, 512))
    def evict(self, n):
        with self.rt.engine.lock:
            self.rt.engine.tree.evict_tokens(n)

    @precondition(lambda self: self.idle or self.pending)
    @rule(data=st.data())
    def delete(self, data):
        cid = data.draw(st.sampled_from(sorted(self.idle + list(self.pending))))
        self.rt.delete_conversation(cid)
        self.pending.pop(cid, None)
        if cid in self.idle:
            self.idle.remove(cid)

    @invariant()
    def consistent(self):
        self.rt.check_integrity()
        host = self.rt.engine.host
        assert set(host.evicted) <= set(self.pending), "a lost tail is recorded only while its owner waits"
        assert not set(host.evicted) & {o for o, e in host.entries.items() if not e.on_device}

    def teardown(self):
        for cid in list(self.rt.conversations):
            self.rt.delete_conversation(cid)


def test_any_interleaving_keeps_integrity():
    machine_rt = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=1024, host_pool_tokens=512,
                                       max_context=1024), background=False)
    OffloadMachine.rt = machine_rt
    try:
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(OffloadMachine, settings=settings(
            max_examples=12, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)))
    finally:
        machine_rt.close()


def test_write_through_copy_is_reused(rt):
    """After a reload the host copy stays ("both"); the next demotion of the same
    chain copies only the tokens added since, and still reloads bit-identically."""
    cid, step = tool_step(rt, "write-through")
    eng = rt.engine
    assert rt.offload.run_due() == CHAIN
    copied = eng.host.stats.demoted_tokens
    step2 = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                                 forced={"tool_calls": [{"name": "f", "arguments": {"x": 2}}]})
    assert step2.accounting.host_loaded_tokens == CHAIN
    residency = {n.residency for n in rt.tree_snapshot(cid)}
    assert residency == {"both", "device"}
    chain = eng.tree.chain_tokens(cid)
    original = pool_kv(rt, eng.tree.chain_slots(cid))
    assert rt.offload.run_due() == chain
    assert eng.host.stats.demoted_tokens - copied == chain - CHAIN  # only the new tokens were copied
    rt.check_integrity()
    step3 = rt.send_tool_results(cid, [{"tool_call_id": step2.tool_calls[0]["id"], "content": "ok"}],
                                 forced={"tool_calls": [{"name": "f", "arguments": {"x": 3}}]})
    assert step3.accounting.host_loaded_tokens == chain
    reloaded = pool_kv(rt, eng.tree.chain_slots(cid)[:chain])
    for (k0, v0), (k1, v1) in zip(original, reloaded):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    rt.delete_conversation(cid)
    assert eng.host.peek(cid) is None
    rt.check_integrity()


def test_discarded_tail_shows_as_evicted_until_recomputed(rt):
    cid, step = tool_step(rt, "discarded", offload="never")
    freed = rt.engine.discard(cid)
    assert freed == CHAIN
    assert [(n.residency, n.tokens) for n in rt.tree_snapshot(cid)] == [("evicted", 144)]  # nodes only
    nxt = resume(rt, cid, step)
    assert nxt.accounting.recomputed_history_tokens == step.accounting.prompt_tokens + step.accounting.output_tokens
    assert "evicted" not in {n.residency for n in rt.tree_snapshot(cid)}
    cid2, _ = tool_step(rt, "discarded-deleted", offload="never")
    rt.engine.discard(cid2)
    rt.delete_conversation(cid2)
    assert cid2 not in rt.engine.host.evicted
    rt.check_integrity()


def test_a_failed_reload_copy_frees_its_slots_and_keeps_the_host_copy(rt):
    cid, step = tool_step(rt, "failing-copy")
    eng = rt.engine
    assert rt.offload.run_due() == CHAIN
    free = eng.pools.allocator.available_size()
    original = eng.mover.to_device

    def broken(host, slots):
        raise RuntimeError("copy failed")

    eng.mover.to_device = broken
    try:
        with pytest.raises(RuntimeError, match="copy failed"):
            resume(rt, cid, step)
    finally:
        eng.mover.to_device = original
    assert eng.pools.allocator.available_size() == free and eng.host.peek(cid) is not None
    rt.check_integrity()
    assert resume(rt, cid, step).accounting.host_loaded_tokens == CHAIN  # the retry reloads
    rt.delete_conversation(cid)


def test_discard_drops_a_write_through_copy_and_release_forgets_the_owner(rt):
    cid, step = tool_step(rt, "discard-both")
    eng = rt.engine
    assert rt.offload.run_due() == CHAIN
    rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                         forced={"tool_calls": [{"name": "f", "arguments": {"x": 2}}]})
    assert eng.host.peek(cid).on_device  # write-through copy of the reloaded head
    eng.discard(cid)
    assert eng.host.peek(cid) is None and {n.residency for n in rt.tree_snapshot(cid)} == {"evicted"}
    eng.release(cid)  # the engine's own API: nothing of the owner stays behind
    assert cid not in eng.host.evicted and all(cid not in n.owners for n in eng.host_nodes(str))
    rt.delete_conversation(cid)
    rt.check_integrity()


def test_a_host_tier_the_machine_cannot_hold_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="cannot allocate the host tier.*lower --host-pool-tokens"):
        Runtime(RuntimeConfig(model="tiny", pool_tokens=1024, host_pool_tokens=10**15), background=False)
    with pytest.raises(ValueError, match="host_pool_tokens must be >= 0"):
        RuntimeConfig(host_pool_tokens=-1)


def test_default_host_tier_is_four_pools_at_most_a_quarter_of_memory():
    cfg = RuntimeConfig(pool_tokens=1024)
    assert cfg.host_tokens(bytes_per_token=4096) == 4096
    quarter = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    assert cfg.host_tokens(bytes_per_token=quarter // 100) == 100
    assert RuntimeConfig(host_pool_tokens=0).host_tokens(4096) == 0


def test_offloaded_nodes_keep_their_ids_hits_and_shape(rt):
    cid, step = tool_step(rt, "node-shape", offload="never")
    rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                         forced={"tool_calls": [{"name": "f", "arguments": {"x": 2}}]})
    before = [(n.id, n.parent, n.tokens, n.depth_tokens, n.hit_count) for n in rt.tree_snapshot(cid)]
    assert len(before) == 2
    # The demotion moves the nodes and the private partial page past them.
    chain = rt.engine.tree.chain_tokens(cid)
    assert chain == before[-1][3] + chain % PAGE and chain % PAGE
    assert rt.engine.demote(cid) == chain
    time.sleep(0.01)
    after = rt.tree_snapshot(cid)
    assert all(n.last_access_age_s >= 0.01 for n in after)  # since the demotion
    assert [(n.id, n.parent, n.tokens, n.depth_tokens, n.hit_count) for n in after] == before
    assert {n.residency for n in after} == {"host"}
    rt.delete_conversation(cid)


def test_the_owners_own_write_through_copy_gives_way_to_its_demotion():
    """A's write-through copy of its head sits at the start of the arena; its grown
    tail needs more room than fits beside it. The demotion drops that copy (and the
    oldest other one) and copies the whole tail, instead of failing after the drop."""
    small = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=4096, host_pool_tokens=1024,
                                  max_context=2048), background=False)
    try:
        a, sa = tool_step(small, "a")
        x, _ = tool_step(small, "x")
        assert small.offload.run_due() == 2 * CHAIN
        small.send_tool_results(a, [{"tool_call_id": sa.tool_calls[0]["id"], "content": words(800)}],
                                forced={"tool_calls": [{"name": "g", "arguments": {}}]})
        chain = small.engine.tree.chain_tokens(a)
        assert chain > 1024 - 128 and small.engine.host.peek(a).on_device  # fits only without its old copy
        assert small.offload.run_due() == chain
        assert small.engine.host.peek(a).anchor_tokens == 0 and small.engine.host.peek(x) is None
        small.check_integrity()
    finally:
        small.close()
