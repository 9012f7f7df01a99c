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
                                  constraint=OutputConstraint(answer_schema=json.dumps(ANSWER), no_call=True,
                                                                think_budget=4))
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


# ----- properties over random schemas ------------------------------------------------------------
# Bounded schemas (a random model writes an unbounded string or integer to the
# output cap): objects, enums, integers in a range, strings with a maxLength,
# nested arrays with maxItems, additionalProperties false.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAMES = st.sampled_from(["a", "b", "city", "n", "ok", "tags", "unit"])
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["c", "f", "x y", "é"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
    st.tuples(st.integers(-20, 20), st.integers(0, 30)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
)


def _objects(children):
    return st.dictionaries(_NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req),
                         "additionalProperties": False}))


_VALUES = st.recursive(_LEAVES, lambda children: st.one_of(
    _objects(children),
    children.map(lambda item: {"type": "array", "items": item, "maxItems": 2})), max_leaves=4)
SCHEMAS = _objects(_VALUES)


@pytest.fixture(scope="module")
def qwen_runtime(tmp_path_factory):
    """Random weights (test_weights.save_hf) over a folder with Qwen's
    tokenizer and Qwen3's official template: the `qwen3` template, and `hf` (Hermes calls) over the same folder."""
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime
    from tests.session_runtime.hf_folders import write_folder
    from tests.session_runtime.test_weights import save_hf

    folder = tmp_path_factory.mktemp("qwen3-constrained")
    save_hf(folder, "llama", vocab=151936, tied=False)
    write_folder(folder, "qwen3")
    rt = Runtime(RuntimeConfig(model=str(folder), pool_tokens=16384, max_context=1024), background=False)
    yield rt
    rt.close()


@pytest.mark.parametrize("template", ["deepseek", "qwen3", "hf"])
def test_random_schemas_give_valid_calls_and_answers(request, template):
    """For random schemas and seeds, on each template's call syntax (DeepSeek's
    DSML, Qwen3's Hermes JSON, the official Qwen3 template read by `hf`): a
    forced call names the tool and its arguments validate against its
    parameters; the answer after the tool's result validates against the same
    schema as an answer schema; the result's step continues the chain (its
    prompt's cached part covers the call's step), and the grammar leaves
    nothing behind."""
    rt = request.getfixturevalue("runtime" if template == "deepseek" else "qwen_runtime")

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(schema=SCHEMAS, seed=st.integers(0, 2**16))
    def check(schema, seed):
        _call_then_answer(rt, template, schema, seed)

    check()


def _call_then_answer(rt, template: str, schema: dict, seed: int) -> None:
    tool = {"type": "function", "function": {"name": "probe", "parameters": schema}}
    cid = rt.create_conversation("Call the tool.", tools=[tool], template=template)
    options = dict(max_tokens=240, temperature=0.8, seed=seed)
    first = rt.send_message(cid, "Go.", constraint=OutputConstraint(call=True, think_budget=8), **options)
    assert first.finish_reason == "tool_calls", (first, schema)
    (call,) = first.tool_calls
    assert call["name"] == "probe"
    jsonschema.validate(call["arguments"], schema)
    second = rt.send_tool_results(
        cid, [{"tool_call_id": call["id"], "content": "done"}],
        constraint=OutputConstraint(answer_schema=json.dumps(schema), no_call=True, think_budget=8), **options)
    assert second.finish_reason == "stop", (second, schema)
    jsonschema.validate(json.loads(second.content), schema)
    assert second.accounting.cached_input_tokens >= first.accounting.prompt_tokens
    rt.delete_conversation(cid)
    rt.check_integrity()
