"""Policy auto (auto_policy.py): the choice against the replay's cost model
(economics.prefill_work is the oracle of every FLOP figure), the outlook it
learns, and a conversation run under it: each closed turn's choice written
and kept, visible on the conversation, the tree view and /metrics, and kept
reasoning dropped once the chain is gone."""

from __future__ import annotations

import pytest

from session_runtime import Runtime, RuntimeConfig
from session_runtime.auto_policy import Outlook, Outlooks, TurnShape, choose
from session_runtime.cost_model import cost_model, default_kv_price, prefill_work

CM = cost_model("qwen3-8b")
PRICE = default_kv_price(CM)
# The seed article's example: P 20,000, R 4,000, A 300, U 100.
SEED = TurnShape(reasoning=4000, tail=300, fork=20000)


def outlook(**changes) -> Outlook:
    base = dict(next_turn=0.8, turns=4.0, period_s=62.0, gap_s=60.0, turn_tokens=400.0, resident=1.0)
    return Outlook(**{**base, **changes})


def test_the_seed_example_drops_for_a_continuing_conversation():
    """Dropping costs |A| of prefill on P once (at the next turn, lazily); keeping
    holds |R| for every later second and gives every later token |R| more
    context, and holds |A| too until the next turn: the seed's trade."""
    got = choose(SEED, outlook(), CM, PRICE)
    assert got.choice == "drop"
    assert got.drop_cost == pytest.approx(0.8 * prefill_work(300, 20000, CM.prefill_chunk).flops(CM))
    held = PRICE * (4000 * 4.0 * 62.0 + 300 * 0.8 * 60.0)
    assert got.keep_cost == pytest.approx(held + CM.attention_flops_per_context * 4000 * 4.0 * 400.0)
    # Built in idle time, the prefill is certain and the tail is held either way.
    built = choose(SEED, outlook(), CM, PRICE, materialized=1.0)
    assert built.drop_cost == pytest.approx(prefill_work(300, 20000, CM.prefill_chunk).flops(CM))
    assert built.keep_cost == pytest.approx(PRICE * 4000 * 4.0 * 62.0
                                            + CM.attention_flops_per_context * 4000 * 4.0 * 400.0)


def test_free_kv_keeps_the_seed_turn():
    """With holding KV free, the |A| prefill outweighs |R| more context for a few turns."""
    assert choose(SEED, outlook(), CM, 0.0).choice == "keep"


def test_a_chain_that_will_not_be_resident_drops():
    """Gone by the next turn, keep prefills P|R|A again and drop P|A: drop costs
    nothing over keep, even with KV free."""
    got = choose(SEED, outlook(resident=0.0), CM, 0.0)
    assert got.choice == "drop" and got.drop_cost == 0.0
    refill = prefill_work(24300, 0, CM.prefill_chunk).flops(CM) - prefill_work(20300, 0, CM.prefill_chunk).flops(CM)
    assert got.keep_cost == pytest.approx(0.8 * refill + CM.attention_flops_per_context * 4000 * 4.0 * 400.0)


def test_a_conversation_about_to_end_keeps():
    """No turn is coming: nothing is saved by dropping, and a canonical branch
    would be prefilled for nothing."""
    assert choose(SEED, outlook(next_turn=0.0, turns=0.0), CM, PRICE).choice == "keep"
    assert choose(SEED, outlook(next_turn=0.0, turns=0.0), CM, PRICE, materialized=1.0).choice == "keep"
    assert choose(TurnShape(0, 300, 20000), outlook(), CM, PRICE).choice == "keep"  # nothing to drop


def test_outlooks_learn_turn_counts_and_pace():
    clock = [0.0]
    o = Outlooks(clock=lambda: clock[0])
    prior = o.outlook("new", "t", 3, 1.0, 100)
    assert prior.next_turn == pytest.approx(0.8) and prior.period_s == 62.0 and prior.turn_tokens == 100
    for k in range(5):  # five conversations of three turns, 30 s apart, each then deleted
        cid = f"c{k}"
        for turn in range(3):
            clock[0] += 30.0
            o.turn_opened(cid, "t", turn)
            clock[0] += 5.0
            o.turn_closed(cid, "t", 200)
        o.ended(cid, "t", 3)
    ending = o.outlook("new", "t", 3, 1.0, 100)
    assert ending.next_turn < 0.1 and ending.turns < 0.5  # they end at three turns
    assert ending.period_s == pytest.approx(35.0) and ending.gap_s == pytest.approx(30.0)
    assert ending.turn_tokens == pytest.approx(200.0)
    assert o.outlook("new", "t", 1, 1.0, 100).next_turn > 0.7  # and go on after one
    # Another tenant starts from every tenant's turn counts, not the prior alone.
    assert o.outlook("new", "other", 3, 1.0, 100).next_turn < 0.5


def _turn(rt: Runtime, cid: str, t: int, reasoning: str = "thinking it over " * 40):
    rt.auto.outlooks.clock.now += 62.0  # a user who answers a minute later, as the replay's nominal clock
    return rt.send_message(cid, f"question {t}", forced={"reasoning": reasoning, "content": f"answer {t}"})


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def auto_rt():
    rt = Runtime(RuntimeConfig(model="tiny", policy="auto", cost_model="qwen3-8b"), background=False)
    rt.auto.outlooks.clock = _Clock()
    yield rt
    rt.close()


def test_each_closed_turn_records_its_choice_and_keeps_it(auto_rt):
    rt = auto_rt
    cid = rt.create_conversation("be brief")
    kept_costs = []
    for t in range(3):
        _turn(rt, cid, t)
        rt.check_integrity()
        record = rt.describe(cid)["turns"][t]["auto"]
        assert record["choice"] == "drop" and record["reason"] == "close"  # a long reasoning, a short answer
        assert record["drop_cost_flops"] < record["keep_cost_flops"] and record["reasoning"] > record["tail"] > 0
        kept_costs.append(record)
    # Written once: a later turn leaves the earlier choices as they were.
    assert [t["auto"] for t in rt.describe(cid)["turns"]] == kept_costs
    history = rt.describe(cid)["history"]
    assert all(not m["reasoning"] for m in history if m["role"] == "assistant")
    view = rt.chain_view(cid)
    assert [t["auto"]["choice"] for t in view["turns"]] == ["drop"] * 3
    counts = {s.name: s for s in rt.metric_samples() if s.name.endswith("auto_choices_total")}
    assert counts, "auto's choices are counted in /metrics"


def test_a_kept_turn_renders_its_reasoning_and_a_lost_chain_drops_it():
    """KV free: a short reasoning under a long answer is kept (the next prompt
    continues the generated sequence whole); once the chain is released, the
    next turn drops that kept reasoning at no cost in reuse, and says so."""
    rt = Runtime(RuntimeConfig(model="tiny", policy="auto", cost_model="qwen3-8b", kv_price=0.0), background=False)
    try:
        cid = rt.create_conversation("be brief")
        step = rt.send_message(cid, "question 0", forced={"reasoning": "hm", "content": "a long answer " * 30})
        record = rt.describe(cid)["turns"][0]["auto"]
        assert record["choice"] == "keep", record
        generated = step.accounting.prompt_tokens + step.accounting.output_tokens
        nxt = rt.send_message(cid, "question 1", forced={"content": "ok"})
        # Kept: the whole generated sequence is reused (the last sampled token aside).
        assert nxt.accounting.cached_input_tokens >= generated - rt.config.page_size - 1
        assert [m["reasoning"] for m in rt.describe(cid)["history"] if m["role"] == "assistant"][0] == "hm"
        rt.backend.release(cid)  # the chain is gone (what a restart or an idle release leaves)
        after = rt.send_message(cid, "question 2", forced={"content": "ok"})
        rt.check_integrity()
        turns = rt.describe(cid)["turns"]
        assert turns[0]["auto"]["choice"] == "drop" and turns[0]["auto"]["reason"] == "not_resident"
        assert turns[0]["auto"]["kept_at_close"]["choice"] == "keep" and turns[0]["auto"]["decided_at_turn"] == 2
        assert after.accounting.rules["auto"]["dropped_turns"] == [0, 1]  # both were kept, both are gone
        assert [m["reasoning"] for m in rt.describe(cid)["history"] if m["role"] == "assistant"][0] == ""
    finally:
        rt.close()


def test_choices_survive_a_restart_and_the_lost_chain_drops_kept_reasoning(tmp_path):
    """The choice is stored with the turn; after a restart the chain is gone,
    so the next turn drops what was kept, and the store says so."""
    config = RuntimeConfig(model="tiny", policy="auto", cost_model="qwen3-8b", kv_price=0.0, data_dir=str(tmp_path))
    rt = Runtime(config, background=False)
    cid = rt.create_conversation("be brief")
    rt.send_message(cid, "question 0", forced={"reasoning": "hm", "content": "a long answer " * 30})
    assert rt.describe(cid)["turns"][0]["auto"]["choice"] == "keep"
    rt.close()
    rt = Runtime(config, background=False)
    try:
        assert rt.describe(cid)["turns"][0]["auto"]["choice"] == "keep"
        step = rt.send_message(cid, "question 1", forced={"content": "ok"})
        assert step.accounting.rules["auto"]["dropped_turns"] == [0]
        assert rt.describe(cid)["turns"][0]["auto"]["reason"] == "not_resident"
    finally:
        rt.close()
    rt = Runtime(config, background=False)
    try:
        assert rt.describe(cid)["turns"][0]["auto"]["reason"] == "not_resident"  # the rewritten record was stored
        assert [m["reasoning"] for m in rt.describe(cid)["history"] if m["role"] == "assistant"][0] == ""
    finally:
        rt.close()
