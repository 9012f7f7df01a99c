"""Replay economics and the counterfactual over a whole trace.

Formulas against hand-computed numbers on a tiny synthetic case (no runtime);
then a 6-turn tool trace replayed at page size 16 under keep and drop: every
turn's counterfactual of the other policy equals the other run's real
first-step prefill, and the economics and prompt compositions add up to the
runs' own accounting.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from session_runtime.accounting import StepAccounting
from session_runtime.config import ModelConfig
from session_runtime.replay import RunSpec, parse_trace
from session_runtime.replay.composition import Composition, reasoning_share
from session_runtime.cost_model import CostModel, Work, decode_work, prefill_work
from session_runtime.replay.clock import Clock, trace_times
from session_runtime.replay.economics import ratios, run_economics, step_work
from session_runtime.replay.run import ReplayResult, TurnResult

# 2 layers, hidden 4, 2 query heads and 1 KV head of dim 2, MLP 8, vocab 10.
SHAPE = ModelConfig(arch="qwen3", vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=2, intermediate_size=8)
CM = CostModel("toy", SHAPE, "bfloat16", prefill_chunk=2)


def acc(prompt: int, prefill: int, output: int, held: int, context: int = 0) -> StepAccounting:
    return StepAccounting(
        prompt_tokens=prompt, cached_input_tokens=prompt - prefill, host_loaded_tokens=0,
        uncached_prefill_tokens=prefill, logical_reusable_tokens=prompt - prefill, alignment_loss_tokens=0,
        recomputed_history_tokens=0, active_context_length=context or prompt + output, output_tokens=output,
        kv_device_bytes=held * 8, kv_host_bytes=0, prefill_ms=0.0, ttft_ms=0.0, tpot_ms=0.0,
        attention_work=prefill * (prompt - prefill) + prefill * (prefill + 1) // 2)


# ----- formulas (no runtime) ---------------------------------------------------------------


def test_cost_model_shape_figures():
    # per layer: q,k,v 4*(4+2+2) = 32, o 4*4 = 16, MLP 3*4*8 = 96: 144; two layers.
    assert CM.non_embedding_params == 288
    assert CM.lm_head_params == 40
    assert CM.attention_flops_per_context == 4 * 2 * 2 * 2
    assert CM.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2  # K and V, layers, kv heads, head dim, bf16


def test_one_step_by_hand():
    # Prompt 5 tokens, 3 prefilled on 2 reused, in chunks of 2; 2 output tokens.
    w = step_work(acc(5, 3, 2, held=7), CM.prefill_chunk)
    assert w == Work(prefill_tokens=3, decode_tokens=2,
                     prefill_attention=3 + 4 + 5,  # the prefilled tokens see 3, 4, 5 positions
                     decode_attention=6 + 7,  # the generated ones 6 and 7
                     forwards=2 + 1,  # two chunks, one decode (the first token is the prefill's)
                     logits_rows=2,
                     kv_read_tokens=(2 + 2) + (2 + 3) + 13)  # each chunk reads up to its end; decode its context
    assert w.prefill_attention == acc(5, 3, 2, 7).attention_work
    assert w.flops(CM) == 2 * 288 * 5 + 32 * (12 + 13) + 2 * 40 * 2 == 3840
    # Weights: 3 forwards of N, the LM head twice; KV: 22 read, 5 written, 16 bytes each.
    assert w.bytes(CM) == (3 * 288 + 2 * 40) * 2 + (22 + 5) * 16 == 2320


def test_prefill_and_decode_edges():
    assert prefill_work(0, 10, 4) == Work()
    assert decode_work(0, 10) == Work()
    assert decode_work(1, 10) == Work(decode_tokens=1, decode_attention=11, forwards=0, logits_rows=1,
                                      kv_read_tokens=11)
    assert prefill_work(5, 0, 2).forwards == 3 and prefill_work(5, 0, 2).kv_read_tokens == 2 + 4 + 5


TWO_TURNS = "\n".join(json.dumps(m) for m in [
    {"role": "user", "content": "a"},
    {"role": "assistant", "reasoning": "r", "tool_calls": [{"name": "f", "arguments": {}}]},
    {"role": "tool", "content": "x"},
    {"role": "assistant", "content": "done"},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": "ok"},
])


def synthetic_run(materialized: tuple[int, int]) -> ReplayResult:
    """Turn 1: a tool step (prompt 10, 10 prefilled, 4 out, chain 14) and the
    answer (prompt 16 on 14, 3 out, closing on a chain of 12, context 15);
    turn 2: one step (prompt 18 on 12, 2 out, chain 20, context 20)."""
    t1 = TurnResult(0, 1, [acc(10, 10, 4, held=14), acc(16, 2, 3, held=12, context=15)], materialized[0])
    t2 = TurnResult(1, 5, [acc(18, 6, 2, held=20, context=20)], materialized[1])
    return ReplayResult(RunSpec("drop", "never"), "c", "t", [t1, t2], kv_bytes_per_token=8)


def test_run_economics_by_hand_on_the_nominal_clock():
    trace = parse_trace(TWO_TURNS)
    clock = Clock(step_s=1.0, tool_s=10.0, think_s=100.0)
    lazy = run_economics(synthetic_run((0, 0)), trace, CM, clock)
    t1, t2 = lazy.turns
    # Steps hold prompt + output while they run, the tool wait the chain, the think time the closed chain.
    assert t1.kv_token_seconds == 1.0 * 14 + 10.0 * 14 + 1.0 * 19 + 100.0 * 12
    assert t2.kv_token_seconds == 1.0 * 20  # the clock ends with the last turn
    assert (t1.kv_held, t2.kv_held, t1.seconds, t2.seconds) == (12, 20, 112.0, 1.0)
    assert lazy.totals()["request_prefill"] == 18 and lazy.totals()["decode_tokens"] == 9
    # Materialized after turn 1: 3 tokens on the fork's 12 (context 15); after turn 2 (the end): 4 on 16.
    mat = run_economics(synthetic_run((3, 4)), trace, CM, clock)
    m1, m2 = mat.turns
    assert m1.idle == prefill_work(3, 12, 2) and m2.idle == prefill_work(4, 16, 2)
    assert (m1.after_end, m2.after_end) == (False, True)
    assert m1.kv_token_seconds == 1.0 * 14 + 10.0 * 14 + 1.0 * 19 + 100.0 * 15  # the canonical branch held
    tot = mat.totals()
    assert (tot["idle_prefill"], tot["idle_prefill_end"], tot["kv_end"]) == (3, 4, 20)
    assert tot["idle_flops"] == prefill_work(3, 12, 2).flops(CM)
    assert tot["end_flops"] == prefill_work(4, 16, 2).flops(CM)
    x = ratios(mat, lazy)
    assert x["request_prefill"] == 1.0 and x["compute_tokens"] == 21 / 18
    assert x["flops_with_end"] > x["flops"] > 1.0


def test_trace_timestamps_make_the_clock():
    step = lambda ts: SimpleNamespace(timestamp=ts)  # noqa: E731
    trace = SimpleNamespace(turns=[
        SimpleNamespace(timestamp=100.0, steps=[step(103.0), step("1970-01-01T00:01:53+00:00")]),  # 113 s
        SimpleNamespace(timestamp=173.0, steps=[step(175.5)]),
    ])
    source, (a, b) = trace_times(trace, Clock(step_s=2.0))
    assert source == "trace"
    assert (a.steps, a.tool_waits, a.think) == ((3.0, 2.0), (8.0, 0.0), 60.0)
    assert (b.steps, b.tool_waits, b.think) == ((2.5,), (0.0,), 0.0)
    trace.turns[1].steps[0].timestamp = None  # one missing: the nominal clock
    source, (a, b) = trace_times(trace, Clock(step_s=2.0, tool_s=5.0, think_s=30.0))
    assert source == "nominal" and (a.steps, a.tool_waits, a.think) == ((2.0, 2.0), (5.0, 0.0), 30.0)


def test_reasoning_share_by_hand():
    comps = [Composition(0, 0, system=10, user=5, markup=1),
             Composition(0, 1, system=10, user=5, reasoning=20, tool_call=4, tool_result=10, markup=1),
             Composition(1, 0, system=10, user=9, reasoning=20, answer=5, tool_call=4, tool_result=10, markup=2)]
    s = reasoning_share("keep", comps)
    assert s.last_view == 20 / 60
    assert s.burden == (0 + 20 + 20) / (16 + 50 + 60)


# ----- replayed: the counterfactual on every turn, and the economics ---------------------------


def words(n: int, w: str = "alpha") -> str:
    return f" {w}" * n  # one token per word in the DeepSeek tokenizer


def call(name: str, **args) -> dict:
    return {"name": name, "arguments": args}


# Six turns: four with tool calls (one with two rounds), two without.
SIX_TURNS = [
    {"type": "conversation", "system": "You are a coding agent." + words(20, "beta"),
     "tools": [{"name": "read", "parameters": {"type": "object"}}, {"name": "grep", "parameters": {"type": "object"}}]},
    {"role": "user", "content": "Why does the build fail?"},
    {"role": "assistant", "reasoning": words(60), "content": "Reading.", "tool_calls": [call("read", path="a.py")]},
    {"role": "tool", "content": words(30, "gamma")},
    {"role": "assistant", "reasoning": words(40), "tool_calls": [call("grep", pattern="def f"), call("read", path="b")]},
    {"role": "tool", "content": words(10, "delta")},
    {"role": "tool", "content": words(12, "gamma")},
    {"role": "assistant", "reasoning": words(30), "content": "An import is missing" + words(8, "beta")},
    {"role": "user", "content": "Fix it."},
    {"role": "assistant", "reasoning": words(50), "tool_calls": [call("read", path="a.py")]},
    {"role": "tool", "content": words(20, "gamma")},
    {"role": "assistant", "reasoning": words(25), "content": "Fixed" + words(5, "beta")},
    {"role": "user", "content": "Thanks, and why?"},
    {"role": "assistant", "reasoning": words(70), "content": "Because" + words(15, "beta")},
    {"role": "user", "content": "Run the tests."},
    {"role": "assistant", "reasoning": words(35), "tool_calls": [call("grep", pattern="test_")]},
    {"role": "tool", "content": words(25, "delta")},
    {"role": "assistant", "reasoning": words(20), "content": "All pass."},
    {"role": "user", "content": "Anything else?"},
    {"role": "assistant", "reasoning": words(45), "tool_calls": [call("read", path="c"), call("grep", pattern="x")]},
    {"role": "tool", "content": words(8, "gamma")},
    {"role": "tool", "content": words(9, "delta")},
    {"role": "assistant", "reasoning": words(15), "content": "No" + words(4, "beta")},
    {"role": "user", "content": "Bye."},
    {"role": "assistant", "reasoning": words(30), "content": "Bye" + words(3, "beta")},
]
MODES = ("never", "always", "auto")


@pytest.fixture(scope="module")
def rt():
    from session_runtime import Runtime, RuntimeConfig

    runtime = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=32768), background=False)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def trace():
    return parse_trace("\n".join(json.dumps(m) for m in SIX_TURNS), source="six_turns.jsonl")


@pytest.fixture(scope="module")
def runs(rt, trace):
    from session_runtime.replay import replay

    out = {(p, m): replay(rt, trace, RunSpec(p, m)) for m in MODES for p in ("keep", "drop")}
    rt.check_integrity()
    return out


def first_prefills(result: ReplayResult) -> list[int]:
    return [t.first.uncached_prefill_tokens for t in result.turns]


def cf(result: ReplayResult, name: str) -> list[int]:
    return [t.row()[f"cf_{name}"] for t in result.turns]


@pytest.mark.parametrize("mode", MODES)
def test_counterfactual_is_the_other_policy_on_every_turn(trace, runs, mode):
    keep, drop = runs["keep", mode], runs["drop", mode]
    assert len(trace.turns) == 6 and trace.n_tool_calls == 7
    assert cf(keep, "drop") == first_prefills(drop)
    assert cf(drop, "keep") == first_prefills(keep)
    assert cf(keep, "keep") == first_prefills(keep) and cf(drop, "drop") == first_prefills(drop)
    # Tool steps need none: both policies continue their own chain and prefill only the results.
    assert [s.uncached_prefill_tokens for t in keep.turns for s in t.steps[1:]] == \
           [s.uncached_prefill_tokens for t in drop.turns for s in t.steps[1:]]


def test_the_trade_is_visible(trace, runs):
    keep, lazy, mat = runs["keep", "never"], runs["drop", "never"], runs["drop", "always"]
    assert sum(first_prefills(mat)) == sum(first_prefills(keep)) < sum(first_prefills(lazy))
    assert mat.turns[-1].materialized > 0 and mat.totals()["materialized_end"] == mat.turns[-1].materialized
    clock = Clock(1.0, 3.0, 30.0)
    from session_runtime.cost_model import cost_model

    cm = cost_model("qwen3-8b")
    k, z, m = (run_economics(r, trace, cm, clock) for r in (keep, lazy, mat))
    for econ, run in ((k, keep), (z, lazy), (m, mat)):
        t = econ.totals()
        assert t["request_prefill"] == run.totals()["prefill"]
        assert t["idle_prefill"] == run.totals()["materialized"]
        assert t["decode_tokens"] == run.totals()["output"]
        assert t["prefill_attention"] == run.totals()["attention_work"]
    # The same tokens are decoded; shorter contexts under drop make decode attention cheaper.
    assert z.totals()["decode_attention"] == m.totals()["decode_attention"] < k.totals()["decode_attention"]
    assert m.totals()["request_prefill"] == k.totals()["request_prefill"]
    # Keep ends holding every token it computed; drop its chain at the last fork: the
    # branch built after the last turn serves no message, so it is left out of the
    # final KV figure as it is from the compute.
    assert k.totals()["kv_end"] == keep.totals()["context"]
    assert m.totals()["kv_end"] == z.totals()["kv_end"] < mat.totals()["context"] < k.totals()["kv_end"]
    assert ratios(z, k)["kv_token_seconds"] < 1.0 < ratios(z, k)["request_prefill"]


def test_compositions_are_the_runs_prompts(rt, trace, runs):
    from session_runtime.replay.analysis import analyze
    from session_runtime.cost_model import cost_model

    keep, drop = runs["keep", "never"], runs["drop", "never"]
    a = analyze(trace, [keep, drop], rt.template(keep.template), cost_model("tiny"))
    assert [c.total for c in a.compositions["keep"]] == [s.prompt_tokens for s in keep.all_steps]
    assert [c.total for c in a.compositions["drop"]] == [s.prompt_tokens for s in drop.all_steps]
    # The last request is turn 6's only step: under drop it carries no reasoning at all.
    last_keep, last_drop = a.compositions["keep"][-1], a.compositions["drop"][-1]
    reasoning = sum([60, 40, 30, 50, 25, 70, 35, 20, 45, 15])  # every step before it, one token a word
    assert last_keep.reasoning == reasoning and last_drop.reasoning == 0
    assert a.shares["drop"].last_view == 0.0 and a.shares["keep"].last_view == reasoning / last_keep.total
    # Tool results and users read the same under both renderings.
    for name in ("system", "user", "tool_result"):
        assert getattr(last_keep, name) == getattr(last_drop, name)
    assert last_keep.tool_call == last_drop.tool_call > 0
    assert a.shares["keep"].burden > a.shares["drop"].burden > 0
    d = a.as_dict()
    assert d["reasoning_share"]["keep"]["lastView"] == a.shares["keep"].last_view
    assert d["runs"][1]["against_keep"]["request_prefill"] > 1.0


def test_sampled_turns_counterfactual_counts_the_unfed_last_token(rt):
    """A sampled step's last token has no KV yet (it was never fed): the shadows
    leave it out as the real chains do, so cf still equals the other policy."""
    steps = {}
    for policy in ("keep", "drop"):
        cid = rt.create_conversation("Sampled." + words(20, "beta"), tenant=f"sampled-{policy}", policy=policy,
                                     materialize="never")
        rt.send_message(cid, "One" + words(5), max_tokens=6)  # greedy: the same output under both
        steps[policy] = rt.send_message(cid, "Two" + words(5), max_tokens=1).accounting
        rt.delete_conversation(cid)
    keep, drop = steps["keep"], steps["drop"]
    assert drop.counterfactual["keep"]["prefill_tokens"] == keep.uncached_prefill_tokens
    assert keep.counterfactual["drop"]["prefill_tokens"] == drop.uncached_prefill_tokens
    assert keep.counterfactual["keep"]["prefill_tokens"] == keep.uncached_prefill_tokens


def test_many_traces_sum_per_policy(rt, trace, runs, tmp_path):
    from session_runtime.replay.analysis import aggregate_dict, analyze, describe_aggregate
    from session_runtime.cost_model import cost_model

    pair = [runs["keep", "never"], runs["drop", "never"]]
    one = analyze(trace, pair, rt.template(pair[0].template), cost_model("tiny"))
    agg = aggregate_dict([one, one])
    for run, single in zip(agg["runs"], one.runs):
        assert run["totals"] == {k: 2 * v for k, v in single.totals().items()}
    assert agg["runs"][1]["against_keep"] == ratios(one.runs[1], one.runs[0])
    assert agg["reasoning_share"]["keep"]["burden"] == pytest.approx(one.shares["keep"].burden)
    assert agg["reasoning_share"]["keep"]["requests"] == 2 * one.shares["keep"].requests
    assert "== all 2 traces: economics per policy (sums) ==" in describe_aggregate([one, one])
    png = one.plot(tmp_path)
    assert png.name == "six_turns.composition.png" and png.read_bytes()[:4] == b"\x89PNG"
