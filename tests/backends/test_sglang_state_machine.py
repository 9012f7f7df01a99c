"""Any interleaving on SGLang's real server keeps the scheduler's tree, pools,
chains, private pages and host tier consistent: steps and tool waits of
several conversations, demotions and promotions in the scheduler, idle
retirement, canonical branches, deletions, and unrelated /generate traffic,
with the control channel's integrity check after every rule."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from session_runtime import PoolExhausted


def words(n: int, w: str = "alpha") -> str:
    return f" {w}" * n


class SGLangMachine(RuleBasedStateMachine):
    rt = None  # the shared SGLang-backed Runtime, set by the test

    def __init__(self):
        super().__init__()
        self.pending: dict[str, str] = {}  # conversation -> pending tool call id
        self.idle: list[str] = []

    @rule(tools=st.booleans(), r=st.integers(0, 30), offload=st.sampled_from(["never", "always", "pressure"]),
          materialize=st.sampled_from(["never", "always"]))
    def open_turn(self, tools, r, offload, materialize):
        cid = self.rt.create_conversation(system=words(24, "sys"), policy="drop", offload=offload,
                                          materialize=materialize, tenant="sm")
        forced = {"reasoning": words(r, "think")}
        forced.update({"tool_calls": [{"name": "f", "arguments": {}}]} if tools else {"content": words(5, "ok")})
        try:
            step = self.rt.send_message(cid, words(3, "hi"), forced=forced)
        except PoolExhausted:
            self.idle.append(cid)
            return
        (self.pending.__setitem__(cid, step.tool_calls[0]["id"]) if tools else self.idle.append(cid))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def answer(self, data):
        cid = data.draw(st.sampled_from(sorted(self.pending)))
        step = self.rt.send_tool_results(cid, [{"tool_call_id": self.pending[cid], "content": "r"}],
                                         forced={"content": words(4, "done")})
        acc = step.accounting
        assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
        del self.pending[cid]
        self.idle.append(cid)

    @precondition(lambda self: self.idle)
    @rule(data=st.data())
    def next_turn(self, data):
        cid = data.draw(st.sampled_from(sorted(self.idle)))
        acc = self.rt.send_message(cid, words(2, "again"), forced={"content": words(3, "yes")}).accounting
        assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens

    @rule()
    def demote_due(self):
        self.rt.offload.run_due()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def demote_one(self, data):
        self.rt.backend.demote(data.draw(st.sampled_from(sorted(self.pending))))

    @rule()
    def canonical_branches(self):
        self.rt.materializer.run_pending()

    @precondition(lambda self: self.idle)
    @rule(data=st.data())
    def retire_idle(self, data):
        cid = data.draw(st.sampled_from(sorted(self.idle)))
        self.rt.backend.mark_idle(cid, 1e-6)  # due at the scheduler's next iteration
        self.rt.backend.control.call("ping")

    @rule(n=st.integers(16, 300), seed=st.integers(0, 10_000))
    def unrelated_traffic(self, n, seed):
        r = httpx.post(f"{self.rt.backend.url}/generate", timeout=300, json={
            "input_ids": [50_000 + (seed * 7 + j) % 40_000 for j in range(n)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text

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

    def teardown(self):
        for cid in list(self.rt.conversations):
            self.rt.delete_conversation(cid)


def test_any_interleaving_keeps_the_scheduler_consistent(sglang_runtime):
    SGLangMachine.rt = sglang_runtime
    run_state_machine_as_test(SGLangMachine, settings=settings(
        max_examples=4, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck)))
