"""Trace formats of `session-runtime replay`: ATIF, OpenAI chat and Anthropic
messages parse to the Trace our JSONL does; detection; greetings and trailing
user messages (notes); tool results matched by id; many traces in one run.

Parsing needs no engine. Two tests replay through the tiny Runtime: the ATIF
sample (its out-of-order results reach the runtime in call order) and the
multi-trace command (the aggregate is the sum of the traces' totals).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from session_runtime.replay import TraceError
from session_runtime.replay.batch import load_traces
from session_runtime.replay.builder import GREETING
from session_runtime.replay.formats import collect_paths, detect, load, read

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRACES = EXAMPLES / "traces"


def calls(step) -> list[str]:
    return [c["name"] for c in step.tool_calls]


# ----- the samples ------------------------------------------------------------------------------


def test_atif_sample():
    t = load(TRACES / "atif_trajectory.json")
    assert (t.format, t.notes) == ("atif", ())
    assert t.system.startswith("You are a CI agent for the `timeparse` repository.")
    assert [x["function"]["name"] for x in t.tools] == ["read_file", "grep", "edit_file", "run_tests"]
    assert [u.user for u in t.turns] == ["The nightly build failed on test_parse_offset. Find out why.",
                                         "Good catch. Fix it and add a test for -01:30.", "Run the parse tests."]
    assert [u.where for u in t.turns] == ["steps[1] (step_id 2)", "steps[5] (step_id 6)", "steps[8] (step_id 9)"]
    first, second, third = t.turns[0].steps
    assert calls(first) == ["read_file", "grep"] and first.content.startswith("Let me look")
    assert first.reasoning.startswith("The failure is in test_parse_offset")
    assert first.tool_calls[1]["arguments"] == {"pattern": "def parse_offset", "path": "timeparse"}
    # The observation lists grep's result first; the step sends them in call order.
    assert second.results == ('41  def test_parse_offset():\n42      assert parse_offset("+05:30") == 330\n'
                              '43      assert parse_offset("-01:00") == -60',
                              "timeparse/offsets.py:12:def parse_offset(text: str) -> int:")
    assert (second.content, calls(second), second.line) == ("", ["read_file"], 4)
    assert calls(third) == [] and third.results[0].startswith("12  def parse_offset")
    assert (len(t.turns), t.n_steps, t.n_tool_calls) == (3, 7, 6)


def test_atif_timestamps_are_the_economics_clock():
    """ATIF steps carry their time: KV token-seconds use it, not the nominal clock."""
    from session_runtime.replay.clock import Clock, trace_times

    trace = load(TRACES / "atif_trajectory.json")
    assert trace.turns[0].timestamp == "2025-11-03T09:00:04Z"
    assert trace.turns[0].steps[0].timestamp == "2025-11-03T09:00:09Z"
    source, times = trace_times(trace, Clock())
    assert source == "trace" and times[0].steps[0] == 5.0  # the first answer came 5 s after the question


def test_openai_sample():
    t = load(TRACES / "openai_messages.json")
    assert (t.format, t.notes) == ("openai", ())
    assert t.system.startswith("You are a maintainer's assistant for the `tablekit` project.")
    assert [x["function"]["name"] for x in t.tools] == ["search_issues", "list_commits", "get_issue"]
    assert t.turns[0].user.startswith("Which open issues mention")  # a content list of text parts
    first, answer = t.turns[0].steps
    assert calls(first) == ["search_issues", "list_commits"] and first.content == ""
    assert first.tool_calls[0]["arguments"] == {"query": "csv export timeout", "state": "open"}
    assert first.reasoning.startswith("Two independent questions")
    # list_commits answered first (call_2b7c), search_issues second: call order here.
    assert [r.split()[0] for r in answer.results] == ["#214", "a41e0d2"]
    assert answer.where == "messages[5]" and answer.line == 6
    assert [len(u.steps) for u in t.turns] == [2, 2, 1]
    assert t.turns[2].steps[0].content.startswith("Fixed: CSV export")


def test_anthropic_sample():
    t = load(TRACES / "anthropic_messages.json")
    assert t.format == "anthropic"
    assert t.notes == ("1 redacted_thinking block(s) cannot be replayed and are left out (the first at messages[11])",)
    assert t.system.startswith("You are a database assistant")  # a list of text blocks
    assert t.tools[0] == {"type": "function", "function": {
        "name": "get_schema", "description": "Columns and indexes of a table.",
        "parameters": {"type": "object", "properties": {"table": {"type": "string"}}, "required": ["table"]}}}
    first, answer = t.turns[0].steps
    assert first.reasoning.startswith("The dashboard's main query filters orders")
    assert first.content == "I'll check the table's indexes and the dashboard query's plan."
    assert calls(first) == ["get_schema", "run_sql"]
    # The user message holds only tool_result blocks: results, not a turn; run_sql's came first.
    assert answer.results[0].startswith("orders(id bigint pk") and answer.results[1].startswith("Limit  (cost")
    assert [u.user for u in t.turns] == ["The orders dashboard got slow this week. Why?", "Add that index.",
                                         "How much faster is the query now?"]
    last = t.turns[2].steps[1]
    assert last.reasoning.startswith("The plan is now an index scan") and last.content.startswith("It now uses")


def test_samples_are_detected():
    assert {p.name: detect(p.read_text()) for p in collect_paths([str(TRACES), str(EXAMPLES / "sample_trace.jsonl")])} == {
        "anthropic_messages.json": "anthropic", "atif_trajectory.json": "atif", "openai_messages.json": "openai",
        "sample_trace.jsonl": "jsonl"}


# ----- detection ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, fmt", [
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]', "openai"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": []}', "openai"),
    ('{"system": "s", "messages": [{"role": "user", "content": "hi"}]}', "anthropic"),
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": "r"}]}]',
     "anthropic"),
    ('{"messages": [], "tools": [{"name": "f", "input_schema": {}}]}', "anthropic"),
    ('{"schema_version": "ATIF-v1.4", "session_id": "x", "agent": {}, "steps": []}', "atif"),
    ('{"role": "user", "content": "hi"}\n{"role": "assistant", "content": "ok"}', "jsonl"),
    ('{"role": "user", "content": "hi"}', "jsonl"),
    ('{"role": "system", "content": "s"}\n{"role": "user", "content": "hi"}', "openai"),
    ('{"role": "user", "content": "hi"}\n{"role": "assistant", "content": "ok", "refusal": null}', "openai"),
])
def test_detect(text, fmt):
    assert detect(text) == fmt


def test_undetectable_is_an_error():
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        detect('{"foo": 1}')


def test_openai_jsonl_names_lines_and_reads_sdk_dumps():
    text = "\n".join(json.dumps(m) for m in [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look "}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "here."}], "name": "ann"},
        {"role": "assistant", "content": None, "reasoning": "need the tool", "refusal": None, "annotations": [],
         "audio": None, "function_call": None,
         "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "done"}]},
        {"role": "assistant", "content": "ok", "reasoning_content": "r", "reasoning": "r"},
    ])
    t = read(text, "t.jsonl")
    assert (t.format, t.system, t.turns[0].user, t.turns[0].where) == ("openai", "Be brief.", "Look here.", "line 2")
    assert t.turns[0].steps[0].forced == {"reasoning": "need the tool", "content": "",
                                          "tool_calls": [{"name": "f", "arguments": {}}]}
    assert t.turns[0].steps[1].results == ("done",)
    assert t.notes == ("1 image_url block(s) cannot be replayed and are left out (the first at line 2)",)


# ----- greetings and trailing user messages --------------------------------------------------------


def _openai(greeting):
    return json.dumps([{"role": "system", "content": "S"}, {"role": "assistant", "content": greeting},
                       {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                       {"role": "user", "content": "and 3+3?"}])


def _anthropic(greeting):
    return json.dumps({"system": "S", "messages": [
        {"role": "assistant", "content": [{"type": "text", "text": greeting}]}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "add", "signature": "x"},
                                          {"type": "text", "text": "4"}]},
        {"role": "user", "content": "and 3+3?"}]})


def _atif(greeting):
    steps = [("system", "S"), ("agent", greeting), ("user", "2+2?"), ("agent", "4"), ("user", "and 3+3?")]
    return json.dumps({"schema_version": "ATIF-v1.6", "session_id": "s", "agent": {"name": "a", "version": "1"},
                       "steps": [{"step_id": i + 1, "source": s, "message": m} for i, (s, m) in enumerate(steps)]})


def _jsonl(greeting):
    return "\n".join(json.dumps(m) for m in [
        {"type": "conversation", "system": "S"}, {"role": "assistant", "content": greeting},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}])


@pytest.mark.parametrize("make, greeting_at, user_at", [
    (_openai, "messages[1]", "messages[4]"), (_anthropic, "messages[0]", "messages[3]"),
    (_atif, "steps[1] (step_id 2)", "steps[4] (step_id 5)"), (_jsonl, "line 2", "line 5"),
])
def test_greeting_is_folded_and_the_trailing_user_skipped(make, greeting_at, user_at):
    t = read(make("Hi! What shall we compute?"), "t")
    assert t.system == "S\n\n" + GREETING + "Hi! What shall we compute?"
    assert [(u.user, [s.content for s in u.steps]) for u in t.turns] == [("2+2?", ["4"])]
    assert t.notes == (
        f"{greeting_at}: an assistant message before the first user message is folded into the system prompt "
        "(its reasoning, if any, is dropped)",
        f"{user_at}: the trace ends with this user message, which has no assistant reply; it is not replayed")


def test_a_trace_of_only_a_greeting_or_a_question_is_an_error():
    with pytest.raises(TraceError, match=r"^messages\[0\]: assistant message before any user message"):
        read('[{"role": "assistant", "content": "hi"}]', "t")
    with pytest.raises(TraceError, match=r"^messages\[0\]: the trace ends after this user message"):
        read('[{"role": "user", "content": "hi"}]', "t")
    with pytest.raises(TraceError, match="with tool calls before any user message"):
        read('[{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]', "t")


def test_a_late_system_message_is_skipped_with_a_note():
    t = read(json.dumps([{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
                         {"role": "assistant", "content": "b"}]), "t")
    assert t.system is None and t.notes == (
        "messages[1]: a system message after the conversation started is not replayed (the runtime has one "
        "system prompt)",)


# ----- tool results matched by id ---------------------------------------------------------------------


def _openai_calls(result_ids):
    return json.dumps([
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": i, "type": "function", "function": {"name": f"f{i}", "arguments": "{}"}}
                                             for i in ("a", "b", "c")]},
        *({"role": "tool", "tool_call_id": i, "content": f"result {i}"} for i in result_ids),
        {"role": "assistant", "content": "done"}])


def test_openai_results_out_of_order_go_to_their_calls():
    t = read(_openai_calls(["c", "a", "b"]), "t")
    assert t.turns[0].steps[1].results == ("result a", "result b", "result c")


def test_anthropic_results_out_of_order_go_to_their_calls():
    uses = [{"type": "tool_use", "id": f"toolu_{i}", "name": f"f{i}", "input": {}} for i in ("a", "b")]
    t = read(json.dumps([
        {"role": "user", "content": "go"}, {"role": "assistant", "content": uses},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_b", "content": "B"},
                                     {"type": "tool_result", "tool_use_id": "toolu_a", "content": "A",
                                      "is_error": True}, {"type": "text", "text": "Hurry."}]},
        {"role": "assistant", "content": "done"}]), "t")
    assert t.turns[0].steps[1].results == ("A\n\nHurry.", "B")  # the text joins the last result block
    assert t.notes == ("messages[2]: text next to tool results is appended to the last result",)


def test_atif_results_without_ids_take_the_calls_in_order():
    t = read(json.dumps({"schema_version": "ATIF-v1.6", "session_id": "s", "agent": {}, "steps": [
        {"step_id": 1, "source": "user", "message": "go"},
        {"step_id": 2, "source": "agent", "message": "", "tool_calls": [
            {"tool_call_id": "x", "function_name": "f", "arguments": {}},
            {"tool_call_id": "y", "function_name": "g", "arguments": {}},
            {"tool_call_id": "z", "function_name": "h", "arguments": {}}],
         "observation": {"results": [{"content": "first"}, {"source_call_id": "x", "content": "X"},
                                     {"content": "second"}]}},
        {"step_id": 3, "source": "agent", "message": "done"}]}), "t")
    # x is named; the results without a source_call_id take y and z in order.
    assert t.turns[0].steps[1].results == ("X", "first", "second")


def test_jsonl_without_ids_keeps_position_and_with_ids_matches_them():
    lines = ['{"role": "user", "content": "go"}',
             '{"role": "assistant", "tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]}',
             '{"role": "tool", "content": "1"}', '{"role": "tool", "content": "2"}', '{"role": "assistant", "content": "ok"}']
    assert read("\n".join(lines), "t").turns[0].steps[1].results == ("1", "2")
    lines[1] = ('{"role": "assistant", "tool_calls": [{"id": "p", "name": "f", "arguments": {}}, '
                '{"id": "q", "name": "g", "arguments": {}}]}')
    lines[2:4] = ['{"role": "tool", "tool_call_id": "q", "content": "2"}', '{"role": "tool", "tool_call_id": "p", "content": "1"}']
    assert read("\n".join(lines), "t").turns[0].steps[1].results == ("1", "2")


@pytest.mark.parametrize("name, text, where", [
    ("openai.json", _openai_calls(["a", "nope", "c"]),
     "messages[3], tool_call_id: tool result for id 'nope', which matches no tool call of messages[1] "
     "(its ids: 'a', 'b', 'c')"),
    ("anthropic.json", json.dumps([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_zz", "content": "A"}]}]),
     "messages[2], content[0].tool_use_id: tool result for id 'toolu_zz', which matches no tool call of "
     "messages[1] (its ids: 'toolu_a')"),
    ("trajectory.json", json.dumps({"schema_version": "ATIF-v1.6", "session_id": "s", "agent": {}, "steps": [
        {"step_id": 1, "source": "user", "message": "go"},
        {"step_id": 2, "source": "agent", "message": "", "tool_calls": [
            {"tool_call_id": "x", "function_name": "f", "arguments": {}}],
         "observation": {"results": [{"source_call_id": "w", "content": "X"}]}}]}),
     "steps[1] (step_id 2), observation.results[0].source_call_id: tool result for id 'w', which matches no "
     "tool call of steps[1] (step_id 2) (its ids: 'x')"),
    ("trace.jsonl", "\n".join([
        '{"role": "user", "content": "go"}',
        '{"role": "assistant", "tool_calls": [{"id": "p", "name": "f", "arguments": {}}]}',
        '{"role": "tool", "tool_call_id": "p2", "content": "1"}']),
     "line 3, tool_call_id: tool result for id 'p2', which matches no tool call of line 2 (its ids: 'p')"),
])
def test_an_unknown_result_id_names_file_record_and_field(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    loaded = load_traces([path])
    assert loaded.traces == [] and loaded.errors == [f"{path}: {where}"]


def test_a_second_result_for_one_call_is_an_error():
    with pytest.raises(TraceError, match=r"^messages\[3\], tool_call_id: a second tool result for call 'a'"):
        read(_openai_calls(["a", "a", "b", "c"]), "t")


@pytest.mark.parametrize("doc, words", [
    ({"session_id": "s", "agent": {}, "steps": []}, 'schema_version: expected "ATIF-v1.x", got None'),
    ({"schema_version": "ATIF-v1.6", "steps": [{"step_id": 1, "source": "robot", "message": ""}]},
     "steps[0] (step_id 1), source: unknown source 'robot'"),
    ({"schema_version": "ATIF-v1.6", "steps": [{"step_id": 1, "source": "user", "message": "go"},
                                               {"step_id": 2, "source": "agent", "message": "",
                                                "tool_calls": [{"tool_call_id": "x", "arguments": {}}]}]},
     "steps[1] (step_id 2), tool_calls[0].function_name: needs a non-empty string"),
    ({"schema_version": "ATIF-v1.6", "steps": [{"step_id": 1, "source": "user", "message": "go"},
                                               {"step_id": 2, "source": "agent", "message": "",
                                                "tool_calls": [{"tool_call_id": "x", "function_name": "f"}]}]},
     "steps[1] (step_id 2): the trace ends with 1 unanswered tool call(s) of this step"),
])
def test_atif_errors_name_step_and_field(doc, words):
    with pytest.raises(TraceError) as info:
        read(json.dumps(doc), "t", "atif")
    assert str(info.value) == words or str(info.value).startswith(words)


# ----- paths --------------------------------------------------------------------------------------


def test_collect_paths_files_folders_and_globs(tmp_path):
    for name in ("b.json", "a.jsonl", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.json").write_text("x")
    got = collect_paths([str(tmp_path), str(tmp_path / "b.json"), str(tmp_path / "**" / "*.json")])
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["a.jsonl", "b.json", "sub/c.json"]
    with pytest.raises(ValueError, match="no such file, folder or matching file"):
        collect_paths([str(tmp_path / "missing.json")])


# ----- through the runtime ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt():
    from session_runtime import Runtime, RuntimeConfig

    runtime = Runtime(RuntimeConfig(model="tiny", page_size=1, pool_tokens=32768), background=False)
    yield runtime
    runtime.close()


def test_atif_sample_replays_with_results_in_call_order(rt):
    from session_runtime.replay import replay

    trace = load(TRACES / "atif_trajectory.json")
    result = replay(rt, trace, "keep", delete=False)
    try:
        entries = rt.describe(result.conversation_id)["trace"]
        assistants = [e for e in entries if e["role"] == "assistant"]
        first_call_ids = [c["id"] for c in assistants[0]["tool_calls"]]
        tools = [(e["tool_call_id"], e["content"]) for e in entries if e["role"] == "tool"][:2]
        # read_file's result goes to read_file's call although the trajectory listed grep's first.
        assert tools == list(zip(first_call_ids, trace.turns[0].steps[1].results))
        assert [c["name"] for c in assistants[0]["tool_calls"]] == ["read_file", "grep"]
        assert [e["content"] for e in entries if e["role"] == "user"] == [u.user for u in trace.turns]
    finally:
        rt.delete_conversation(result.conversation_id)
    t = result.totals()
    assert (t["steps"], t["recomputed"]) == (7, 0)
    assert t["prefill"] + t["output"] == t["context"]  # keep: every token computed once
    rt.check_integrity()


def test_cli_replays_many_traces_and_prints_the_aggregate(rt, tmp_path, monkeypatch, capsys):
    from session_runtime.replay import add_arguments, run_command

    (tmp_path / "one.json").write_text(json.dumps([
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5", "reasoning_content": "2 + 3 = 5."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Welcome."}]))
    (tmp_path / "two.json").write_text(json.dumps({"system": "Be terse.", "messages": [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Paris.", "signature": "s"},
                                          {"type": "text", "text": "Paris."}]},
        {"role": "user", "content": "Thanks"}]}))
    # The module's Runtime stands in for the one the command would load (a second model load).
    monkeypatch.setattr("session_runtime.runtime.Runtime", lambda config, background: rt)
    monkeypatch.setattr(rt, "close", lambda: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out_json = tmp_path / "out.json"
    args = parser.parse_args([str(tmp_path / "*.json"), "--policy", "keep", "--policy", "drop:never",
                              "--no-progress", "--json", str(out_json)])
    assert run_command(args) == 0
    out = capsys.readouterr().out
    assert f"trace {tmp_path / 'one.json'} (openai): 2 turns, 2 steps, 0 tool calls" in out
    assert f"trace {tmp_path / 'two.json'} (anthropic): 1 turns, 1 steps, 0 tool calls" in out
    assert ("  note: messages[2]: the trace ends with this user message, which has no assistant reply; "
            "it is not replayed") in out
    report = json.loads(out_json.read_text())
    assert [t["format"] for t in report["traces"]] == ["openai", "anthropic"] and "runs" not in report
    aggregate = {a["label"]: a for a in report["aggregate"]}
    for label, index in (("keep", 0), ("drop:never", 1)):
        per_trace = [t["runs"][index]["totals"] for t in report["traces"]]
        assert aggregate[label]["traces"] == 2
        assert aggregate[label]["totals"]["prefill"] == sum(t["prefill"] for t in per_trace)
        assert aggregate[label]["totals"]["prompt"] == sum(t["prompt"] for t in per_trace)
    # The printed aggregate table carries the same sums.
    table = out.split("== all 2 traces: totals per policy ==")[1]
    row = next(line.split() for line in table.splitlines() if line.startswith("keep "))
    keep = aggregate["keep"]["totals"]
    assert row[1:4] == [str(keep["steps"]), str(keep["prompt"]), str(keep["cached"])]
