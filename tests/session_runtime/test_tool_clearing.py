"""Anthropic's clear_tool_uses_20250919 as the server decides it
(session_runtime/tool_clearing.py): the trigger, keep, exclude_tools,
clear_at_least, clear_tool_inputs, the open step's results never cleared, and
the request's bad settings refused naming the field."""

from __future__ import annotations

import pytest

from session_runtime.api.messages_input import context_edits
from session_runtime.errors import InvalidRequest
from session_runtime.templates import build_template
from session_runtime.templates.base import Message, ToolCall
from session_runtime.tokenizer import load_tokenizer
from session_runtime.tool_clearing import NOTHING, PLACEHOLDER, Cleared, ToolUse, ToolUseEdit, apply, decide, \
    parse, tool_uses

WORDS = lambda text: len(text.split())  # noqa: E731  (a tokenizer for the decisions: one token a word)


def uses(n: int, names=None, words: int = 10) -> list[ToolUse]:
    return [ToolUse(f"t{i}", (names or {}).get(i, "read"), '{"path": "x"}', " ".join(["w"] * words))
            for i in range(n)]


def test_nothing_is_cleared_below_the_trigger():
    edit = ToolUseEdit(trigger=("input_tokens", 1000))
    assert decide(edit, uses(6), frozenset(), 1000, WORDS) is NOTHING
    assert decide(edit, uses(6), frozenset(), 1001, WORDS).results == {"t0", "t1", "t2"}  # keep 3 by default
    by_count = ToolUseEdit(trigger=("tool_uses", 5), keep=1)
    assert decide(by_count, uses(5), frozenset(), None, WORDS) is NOTHING
    assert decide(by_count, uses(6), frozenset(), None, WORDS).results == {"t0", "t1", "t2", "t3", "t4"}


def test_excluded_tools_and_the_open_steps_results_stay():
    edit = ToolUseEdit(trigger=("tool_uses", 0), keep=0, exclude_tools=frozenset({"grep"}))
    got = decide(edit, uses(5, names={1: "grep"}), frozenset({"t4"}), None, WORDS)
    assert got == Cleared(frozenset({"t0", "t2", "t3"}), frozenset())


def test_clear_at_least_clears_the_oldest_until_reached_and_nothing_short_of_it():
    # Each result frees 10 words less the placeholder's.
    freed = 10 - WORDS(PLACEHOLDER)
    edit = ToolUseEdit(trigger=("tool_uses", 0), keep=1, clear_at_least=freed + 1)
    assert decide(edit, uses(6), frozenset(), None, WORDS).results == {"t0", "t1"}
    too_much = ToolUseEdit(trigger=("tool_uses", 0), keep=1, clear_at_least=freed * 5 + 1)
    assert decide(too_much, uses(6), frozenset(), None, WORDS) is NOTHING


def test_clear_tool_inputs_by_name():
    edit = ToolUseEdit(trigger=("tool_uses", 0), keep=1, clear_inputs=frozenset({"grep"}))
    got = decide(edit, uses(4, names={0: "grep", 2: "grep"}), frozenset(), None, WORDS)
    assert got.results == {"t0", "t1", "t2"} and got.inputs == {"t0", "t2"}


def test_tool_uses_of_chat_messages():
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "read", "arguments": "{}"}},
                    {"id": "b", "type": "function", "function": {"name": "grep", "arguments": "{\"q\": 1}"}}]},
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "tool", "tool_call_id": "a", "content": "A"}]
    assert tool_uses(messages) == [ToolUse("a", "read", "{}", "A"), ToolUse("b", "grep", "{\"q\": 1}", "B")]


def test_apply_rewrites_results_and_inputs_only():
    tpl = build_template("deepseek", load_tokenizer("tiny"))
    calls = (ToolCall("a", "read", {"path": "/etc/hosts"}), ToolCall("b", "grep", {"q": "x"}))
    assistant = Message("assistant", 0, "", "hmm", calls, output_ids=tuple(tpl.forced_ids("hmm", "", list(calls))))
    history = [Message("user", 0, "go"), assistant, Message("tool", 0, "A" * 50, tool_call_id="a"),
               Message("tool", 0, "B", tool_call_id="b")]
    out = apply(tpl, history, Cleared(frozenset({"a"}), frozenset({"a"})))
    assert out[0] is history[0] and out[3] is history[3]
    assert out[2].content == PLACEHOLDER
    assert [c.arguments for c in out[1].tool_calls] == [{}, {"q": "x"}]
    back = tpl.parse_output(list(out[1].output_ids), "")
    assert back.reasoning.strip() == "hmm" and [(c.name, c.arguments) for c in back.tool_calls] == \
        [("read", {}), ("grep", {"q": "x"})]
    assert apply(tpl, history, NOTHING) == history


@pytest.mark.parametrize("edit, field", [
    ({"type": "clear_tool_uses_20250919", "trigger": {"type": "messages", "value": 3}}, "edits.0.trigger"),
    ({"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}, "edits.0.keep.value"),
    ({"type": "clear_tool_uses_20250919", "exclude_tools": "read"}, "edits.0.exclude_tools"),
    ({"type": "clear_tool_uses_20250919", "clear_tool_inputs": "yes"}, "edits.0.clear_tool_inputs"),
    ({"type": "clear_tool_uses_20250919", "keep_all": True}, "edits.0.keep_all"),
    ({"type": "compact_20260112"}, "edits.0.type"),
])
def test_bad_settings_name_their_field(edit, field):
    with pytest.raises(InvalidRequest) as info:
        context_edits({"context_management": {"edits": [edit]}})
    assert info.value.param == f"context_management.{field}"


def test_the_edits_order_and_count():
    thinking = {"type": "clear_thinking_20251015", "keep": "all"}
    tools = {"type": "clear_tool_uses_20250919"}
    on = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    edits = context_edits({**on, "context_management": {"edits": [thinking, tools]}})
    assert edits.thinking.keep_turns is None and edits.tools == ToolUseEdit()
    for wrong in ([tools, thinking], [tools, tools]):
        with pytest.raises(InvalidRequest) as info:
            context_edits({**on, "context_management": {"edits": wrong}})
        assert info.value.param == "context_management.edits.1"
    assert parse({"type": "clear_tool_uses_20250919", "clear_tool_inputs": ["grep"],
                  "clear_at_least": {"type": "input_tokens", "value": 5000}}, "e") == \
        ToolUseEdit(clear_at_least=5000, clear_inputs=frozenset({"grep"}))
