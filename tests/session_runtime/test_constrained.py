"""Constrained output on the embedded engine (tiny preset, random weights):
a forced tool call whose arguments validate against the tool's schema, an
answer that validates against a JSON schema, and a stop sequence that ends the
output, each continuing the conversation's chain like any other step."""

from __future__ import annotations

import json

import jsonschema
import pytest

from session_runtime.constrained.spec import OutputConstraint, stop_sequences
from session_runtime.errors import InvalidRequest

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def runtime():
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    rt = Runtime(RuntimeConfig(model="tiny", pool_tokens=16384, max_context=1024), background=False)
    yield rt
    rt.close()


@pytest.fixture
def rt(runtime):
    yield runtime
    for cid in list(runtime.conversations):
        runtime.delete_conversation(cid)


def test_a_forced_call_then_a_schema_answer(rt):
    cid = rt.create_conversation("You call tools.", tools=[TOOL])
    first = rt.send_message(cid, "Weather?", max_tokens=200,
                            constraint=OutputConstraint(call=True, tools=("lookup",), think_budget=4))
    assert first.finish_reason == "tool_calls", first
    (call,) = first.tool_calls
    assert call["name"] == "lookup"
    jsonschema.validate(call["arguments"], TOOL["function"]["parameters"])
    second = rt.send_tool_results(cid, [{"tool_call_id": call["id"], "content": "sunny"}], max_tokens=200,
                                  constraint=OutputConstraint(answer_schema=json.dumps(ANSWER), think_budget=4))
    assert second.finish_reason == "stop", second
    jsonschema.validate(json.loads(second.content), ANSWER)
    # The result's step continued the chain: the first step's prompt and output were not prefilled again.
    assert second.accounting.cached_input_tokens >= first.accounting.prompt_tokens
    rt.check_integrity()


def test_a_stop_sequence_ends_the_output(rt):
    cid = rt.create_conversation("Be brief.")
    free = rt.send_message(cid, "Say something.", max_tokens=30)
    stop = rt.tokenizer.decode(free.output_ids)[10:13]
    cid = rt.create_conversation("Be brief.")
    step = rt.send_message(cid, "Say something.", max_tokens=30, constraint=OutputConstraint(stop=(stop,)))
    assert step.finish_reason == "stop" and step.stop_sequence == stop
    assert len(step.output_ids) < len(free.output_ids)
    assert step.output_ids == free.output_ids[: len(step.output_ids)]  # greedy: the same tokens, cut
    assert stop not in step.reasoning + step.content


def test_bad_constraints_are_refused_and_change_nothing(rt):
    cid = rt.create_conversation("s", tools=[TOOL])
    with pytest.raises(InvalidRequest):
        rt.send_message(cid, "x", max_tokens=8, constraint=OutputConstraint(answer_schema=json.dumps(
            {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})))
    assert rt.get(cid).turns == []
    for bad in ([""], ["x"] * 5, [1], "y" * 300):
        with pytest.raises(InvalidRequest):
            stop_sequences(bad, "stop", 4)
