"""`session-runtime replay`: trace validation, and the sample trace replayed
under keep, drop (lazy) and drop (materialized) with exact, explainable totals.

Page size 1, so every count is exact (no page alignment). The DeepSeek template
renders a user message as <User> U <Assistant> plus one marker (<think> when the
turn keeps reasoning, </think> when it drops it): |U| + 3 tokens; tool results
as one encoded block plus one marker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from session_runtime.cli import main
from session_runtime.replay import TraceError, load_trace, parse_trace

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sample_trace.jsonl"
U, A, T = '{"role": "user", "content": "hi"}', '{"role": "assistant", "content": "ok"}', '{"role": "tool", "content": "4"}'
CALL = '{"role": "assistant", "reasoning": "r", "tool_calls": [{"name": "calc", "arguments": {"x": "2+2"}}]}'


# ----- parsing (no runtime) ---------------------------------------------------------------


@pytest.mark.parametrize("lines, line, words", [
    ([U, A, '{"role": "user", "content": "x"'], 3, "invalid JSON"),
    ([U, '{"role": "bot", "content": "x"}'], 2, "unknown role 'bot'"),
    ([U, A, T], 3, "tool result without a pending tool call"),
    ([U, CALL, T, T], 4, "all answered"),
    ([U, CALL, U], 3, "1 tool call(s) of line 2 are unanswered"),
    ([U, CALL, T, U], 4, "wait for an assistant reply"),
    ([A], 1, "before any user message"),
    ([U, A, A], 3, "turn closed at line 2"),
    ([U, U], 2, "no assistant reply"),
    ([U, '{"role": "assistant", "content": "ok", "reasonning": "typo"}'], 2, "unknown field(s) 'reasonning'"),
    ([U, A, '{"type": "conversation", "system": "late"}'], 3, "must be the first line"),
    ([U, '{"role": "assistant", "tool_calls": [{"arguments": {}}]}'], 2, "tool_calls[0] needs a non-empty string name"),
    ([U, CALL, '{"role": "tool", "name": "search", "content": "4"}'], 3, "which is 'calc'"),
    ([U, CALL], 2, "ends with 1 unanswered tool call(s)"),
    ([U], 1, "ends after this user message"),
])
def test_parse_errors_name_the_line(lines, line, words):
    with pytest.raises(TraceError) as info:
        parse_trace("\n".join(lines))
    assert info.value.line == line
    assert str(info.value).startswith(f"line {line}: ")
    assert words in str(info.value)


def test_parse_accepts_blank_lines_openai_calls_and_runtime_metadata():
    trace = parse_trace("\n".join([
        '{"type": "conversation", "system": "s", "tools": [{"name": "calc"}]}', "", U,
        '{"role": "assistant", "reasoning_content": "r", "tool_calls": [{"id": "c1", "type": "function", '
        '"function": {"name": "calc", "arguments": "{\\"x\\": 1}"}}]}',
        '{"role": "tool", "tool_call_id": "c1", "content": "1", "turn": 0}', A,
    ]))
    (turn,) = trace.turns
    assert (trace.system, turn.line, [s.line for s in turn.steps]) == ("s", 3, [4, 6])
    assert turn.steps[0].forced == {"reasoning": "r", "content": "", "tool_calls": [{"name": "calc", "arguments": {"x": 1}}]}
    assert turn.steps[1].results == ("1",)


def test_sample_trace_is_a_coding_agent_with_long_reasoning():
    trace = load_trace(SAMPLE)
    assert len(trace.turns) >= 4
    for turn in trace.turns:
        assert 2 <= sum(len(s.tool_calls) for s in turn.steps) <= 3
    reasoning = sum(len(s.reasoning) for t in trace.turns for s in t.steps)
    answers = sum(len(s.content) for t in trace.turns for s in t.steps)
    assert reasoning > 4 * answers


# ----- replay -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt():
    from session_runtime import Runtime, RuntimeConfig

    runtime = Runtime(RuntimeConfig(model="tiny", page_size=1, pool_tokens=32768), background=False)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def trace():
    return load_trace(SAMPLE)


@pytest.fixture(scope="module")
def runs(rt, trace):
    """The sample trace under keep and drop, each with materialize never and
    always (keep's setting is the one its drop counterfactual uses), in fresh tenants."""
    from session_runtime.replay import RunSpec, replay

    out = {f"{p}:{m}": replay(rt, trace, RunSpec(p, m)) for m in ("never", "always") for p in ("keep", "drop")}
    rt.check_integrity()
    return out


def user_tokens(rt, text: str) -> int:
    return len(rt.tokenizer.encode(text)) + 3  # <User> text <Assistant> marker


def results_tokens(rt, results) -> int:
    text = "\n\n<function_results>" + "".join(f"\n<result>{c}</result>" for c in results) + "\n</function_results>\n\n"
    return len(rt.tokenizer.encode(text)) + 1  # the block, then the marker


def test_keep_prefills_each_token_once(rt, trace, runs):
    keep = runs["keep:never"]
    for k, (turn, res) in enumerate(zip(trace.turns, keep.turns)):
        first = res.first
        if k:  # the whole previous sequence is reused: only the new message is prefilled
            assert first.uncached_prefill_tokens == user_tokens(rt, turn.user)
            assert first.cached_input_tokens == keep.turns[k - 1].steps[-1].active_context_length
            assert first.cache_state == "generated_branch"
        for ts, acc in zip(turn.steps[1:], res.steps[1:]):  # tool steps: only the results
            assert acc.uncached_prefill_tokens == results_tokens(rt, ts.results)
    t = keep.totals()
    assert t["recomputed"] == 0 and t["materialized"] == 0
    assert t["prefill"] + t["output"] == t["context"]  # every token computed exactly once
    assert t["turn_start_prefill"] == runs["drop:always"].totals()["turn_start_prefill"]


def test_drop_without_materialization_recomputes_the_answers(rt, trace, runs):
    lazy, keep = runs["drop:never"], runs["keep:never"]
    for k in range(1, len(trace.turns)):
        prev, acc = lazy.turns[k - 1], lazy.turns[k].first
        tail = prev.steps[-1].active_context_length - prev.fork_tokens  # canonical tokens past the fork
        assert acc.cached_input_tokens == prev.fork_tokens
        assert acc.recomputed_history_tokens == tail
        assert acc.uncached_prefill_tokens == tail + user_tokens(rt, trace.turns[k].user)
        assert acc.cache_state == "prefix_only"
    # The next context is shorter by every step's reasoning and its </think>.
    reasoning = sum(len(rt.tokenizer.encode(s.reasoning)) + 1 for t in trace.turns for s in t.steps)
    assert keep.totals()["context"] - lazy.totals()["context"] == reasoning
    assert lazy.totals()["output"] == keep.totals()["output"]
    # Tool steps inside the open turn recompute nothing under drop either.
    assert lazy.totals()["tool_prefill"] == keep.totals()["tool_prefill"]


@pytest.mark.parametrize("mode", ["never", "always"])
def test_counterfactuals_are_the_other_policy_on_every_turn(runs, mode):
    """Each run's counterfactual of the other policy is the other run's real
    first-step prefill on every turn, not only the second: the shadows follow
    each policy's own chain (drop's with the conversation's materialize setting)."""
    keep, drop = runs[f"keep:{mode}"].turns, runs[f"drop:{mode}"].turns
    real = lambda turns: [t.first.uncached_prefill_tokens for t in turns]  # noqa: E731
    assert [t.row()["cf_drop"] for t in keep] == real(drop)
    assert [t.row()["cf_keep"] for t in drop] == real(keep)
    # The counterfactual of the run's own policy is its real prefill.
    assert [t.row()["cf_keep"] for t in keep] == real(keep)
    assert [t.row()["cf_drop"] for t in drop] == real(drop)
    # Tool steps need none: under both they continue their own chain and prefill the results only.
    assert [s.uncached_prefill_tokens for t in keep for s in t.steps[1:]] == \
           [s.uncached_prefill_tokens for t in drop for s in t.steps[1:]]


def test_materialization_moves_the_recompute_into_idle_time(rt, trace, runs):
    mat, lazy = runs["drop:always"], runs["drop:never"]
    for k in range(1, len(trace.turns)):
        assert mat.turns[k].first.uncached_prefill_tokens == user_tokens(rt, trace.turns[k].user)
        assert mat.turns[k].first.cache_state == "canonical_branch"
        assert mat.turns[k - 1].materialized == lazy.turns[k].first.recomputed_history_tokens
    m, z = mat.totals(), lazy.totals()
    assert m["prefill"] == runs["keep:never"].totals()["prefill"]
    # Same work as lazy drop; the last turn's branch, which no message used, apart.
    assert m["prefill"] + m["materialized"] == z["prefill"]
    assert m["materialized_end"] == mat.turns[-1].materialized > 0 and z["materialized_end"] == 0
    assert m["context"] == z["context"]


# ----- the CLI ------------------------------------------------------------------------------------


def test_cli_prints_turn_and_totals_tables(rt, tmp_path, capsys):
    path = tmp_path / "short.jsonl"
    lines = [
        {"type": "conversation", "system": "You are terse.", "tools": [{"name": "calc", "parameters": {}}]},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "reasoning": "Use the calculator for 2 + 3.", "tool_calls": [
            {"name": "calc", "arguments": {"expression": "2 + 3"}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "reasoning": "It returned 5.", "content": "5"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "reasoning": "Nothing to do.", "content": "You're welcome."},
    ]
    path.write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    out_json = tmp_path / "out.json"
    rc = main(["replay", str(path), "--policy", "keep", "--policy", "drop:never", "--page-size", "1",
               "--pool-tokens", "4096", "--no-progress", "--json", str(out_json), "--cost-model", "qwen3-8b",
               "--plot", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "== keep: policy=keep ==" in out and "== drop:never: policy=drop materialize=never ==" in out
    assert "== totals ==" in out and "cache_state" in out and "cf_keep" in out
    report = json.loads(out_json.read_text())
    runs = {r["label"]: r for r in report["runs"]}
    keep2 = runs["keep"]["turns"][1]
    assert keep2["prefill"] == user_tokens(rt, "Thanks!") and keep2["state"] == "generated_branch"
    assert runs["drop:never"]["turns"][1]["cf_keep"] == keep2["prefill"]
    # The printed keep row of turn 2 carries the same numbers.
    row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["2", "6"])
    assert row[2:6] == ["1", str(keep2["prompt"]), str(keep2["cached"]), str(keep2["prefill"])]
    # The economics section, its JSON and the composition plot.
    assert "== economics: cost model qwen3-8b (bfloat16), clock nominal" in out and "lastView" in out
    econ = report["economics"]
    assert econ["cost_model"]["name"] == "qwen3-8b" and econ["cost_model"]["num_layers"] == 36
    keep_econ = econ["runs"][0]
    assert keep_econ["turns"][1]["request"]["prefill_tokens"] == runs["keep"]["totals"]["prefill"] - \
        keep_econ["turns"][0]["request"]["prefill_tokens"]
    assert econ["runs"][1]["against_keep"]["request_prefill"] > 1.0
    assert set(econ["reasoning_share"]) == {"keep", "drop"} and econ["reasoning_share"]["drop"]["lastView"] == 0.0
    assert (tmp_path / "plots" / "short.composition.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_a_bad_trace_with_its_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(U + "\n" + A + "\n" + T + "\n")
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 3: tool result without a pending tool call" in err


def test_plain_progress_bar_without_tqdm(monkeypatch):
    import io
    import sys

    from session_runtime.replay import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    buf = io.StringIO()
    bar = Progress(4, stream=buf)
    bar.set("keep")
    for _ in range(4):
        bar.update()
    bar.close()
    assert buf.getvalue().endswith(f"\r{'keep':<24} [{'#' * 30}] 4/4\n")
