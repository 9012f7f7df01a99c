"""Constrained output on SGLang's real server: the step's structural tag and
stop sequences go to its grammar backend (xgrammar) and its stop matching,
and give the embedded engine's tokens, token for token, on the same weights
(greedy). Uses the session's shared SGLang server (tests/conftest.py),
launched with the runtime's tokenizer written beside it and
`--grammar-backend xgrammar`."""

from __future__ import annotations

import json

import jsonschema
import pytest

from session_runtime.constrained.spec import OutputConstraint

from tests.session_runtime.test_constrained import ANSWER, TOOL  # the embedded engine's test's schemas


def _run(rt, constraint: OutputConstraint, max_tokens: int = 160):
    cid = rt.create_conversation("You call tools.", tools=[TOOL])
    try:
        first = rt.send_message(cid, "Weather in Paris?", max_tokens=max_tokens, constraint=constraint)
        second = None
        if first.tool_calls:
            answer = OutputConstraint(answer_schema=json.dumps(ANSWER), no_call=True, think_budget=8)
            second = rt.send_tool_results(cid, [{"tool_call_id": first.tool_calls[0]["id"], "content": "sunny"}],
                                          max_tokens=max_tokens, constraint=answer)
        return first, second, rt.get(cid).chain_tokens
    finally:
        rt.delete_conversation(cid)


@pytest.mark.parametrize("runtime", ["sglang_runtime", "embedded_twin"])
def test_a_forced_call_and_a_schema_answer_validate(runtime, request):
    rt = request.getfixturevalue(runtime)
    first, second, _ = _run(rt, OutputConstraint(call=True, tools=("lookup",), think_budget=8))
    assert first.finish_reason == "tool_calls", first
    (call,) = first.tool_calls
    assert call["name"] == "lookup"
    jsonschema.validate(call["arguments"], TOOL["function"]["parameters"])
    assert second is not None and second.finish_reason == "stop", second
    jsonschema.validate(json.loads(second.content), ANSWER)
    # The tool result's step continued the chain: only its new tokens were prefilled.
    assert second.accounting.cached_input_tokens >= first.accounting.prompt_tokens - 16


def test_both_backends_give_the_same_tokens(sglang_runtime, embedded_twin):
    constraint = OutputConstraint(call=True, tools=("lookup",), think_budget=8)
    a, b = _run(sglang_runtime, constraint), _run(embedded_twin, constraint)
    assert a[0].output_ids == b[0].output_ids
    assert a[1].output_ids == b[1].output_ids


@pytest.mark.parametrize("runtime", ["sglang_runtime", "embedded_twin"])
def test_a_stop_sequence_ends_the_output(runtime, request):
    rt = request.getfixturevalue(runtime)
    cid = rt.create_conversation("Be brief.")
    try:
        free = rt.send_message(cid, "Say something.", max_tokens=40)
        text = rt.tokenizer.decode(free.output_ids)
        stop = text[12:15]  # a piece of what the model writes unconstrained (greedy)
        rt.delete_conversation(cid)
        cid = rt.create_conversation("Be brief.")
        step = rt.send_message(cid, "Say something.", max_tokens=40, constraint=OutputConstraint(stop=(stop,)))
        assert step.finish_reason == "stop" and step.stop_sequence == stop
        assert len(step.output_ids) < len(free.output_ids)
        assert stop in rt.tokenizer.decode(step.output_ids)
        assert stop not in step.reasoning + step.content
    finally:
        rt.delete_conversation(cid)


def test_random_schemas_agree_on_both_backends(sglang_runtime, embedded_twin):
    """For random bounded schemas (tests/session_runtime/test_constrained.py),
    greedy: SGLang's grammar backend and the embedded engine's mask give the
    same call and the same answer, token for token, and both validate."""
    from hypothesis import HealthCheck, given, settings

    from tests.session_runtime.test_constrained import SCHEMAS

    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(schema=SCHEMAS)
    def check(schema):
        tool = {"type": "function", "function": {"name": "probe", "parameters": schema}}
        outputs = []
        for rt in (sglang_runtime, embedded_twin):
            cid = rt.create_conversation("Call the tool.", tools=[tool])
            try:
                first = rt.send_message(cid, "Go.", max_tokens=200,
                                        constraint=OutputConstraint(call=True, think_budget=8))
                (call,) = first.tool_calls
                jsonschema.validate(call["arguments"], schema)
                second = rt.send_tool_results(cid, [{"tool_call_id": call["id"], "content": "done"}], max_tokens=200,
                                              constraint=OutputConstraint(answer_schema=json.dumps(schema),
                                                                          no_call=True, think_budget=8))
                jsonschema.validate(json.loads(second.content), schema)
                outputs.append((first.output_ids, second.output_ids))
            finally:
                rt.delete_conversation(cid)
        assert outputs[0] == outputs[1]

    check()
