"""The seed's wire-shape table: DeepSeek's validator on the raw shapes, and on
what strip() sends with default options, with passthrough and without the
nudge rewrite."""

from __future__ import annotations

import copy

import pytest

from session_runtime.protocols import StripOptions, get_protocol
from tests.protocols.shapes import EXPECTED, SHAPES

DEEPSEEK = get_protocol("deepseek")
MISSING = "The `reasoning_content` in the thinking mode must be passed back to the API."


def status(body: dict) -> int:
    error = DEEPSEEK.validate(body)
    if error is None:
        return 200
    assert error.body == {"error": {"message": MISSING, "type": "invalid_request_error", "param": None,
                                    "code": "invalid_request_error"}}
    assert error.name == "deepseek.reasoning_content_missing"
    assert DEEPSEEK.known_error(error.status, error.body) == "deepseek.reasoning_content_missing"
    return error.status


def sent(body: dict, options: StripOptions) -> dict:
    return DEEPSEEK.render_request(DEEPSEEK.strip(DEEPSEEK.parse_request(body), options).request)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_raw_shapes_answer_as_the_live_api_did(name):
    assert status(SHAPES[name]()) == EXPECTED[name].raw


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_stripped_shapes(name):
    body, expected = SHAPES[name](), EXPECTED[name]
    result = DEEPSEEK.strip(DEEPSEEK.parse_request(body), StripOptions())
    assert (result.mode, result.stripped_indexes, result.nudge_rewritten) == (
        expected.mode, expected.stripped_indexes, expected.nudge_rewritten)
    out = DEEPSEEK.render_request(result.request)
    assert status(out) == expected.stripped
    if expected.mode == "strict":
        assert out == body
    for i, (before, after) in enumerate(zip(body["messages"], out["messages"])):
        if i in expected.stripped_indexes:  # the key is gone, nothing else changed
            assert "reasoning_content" not in after
            assert after == {k: v for k, v in before.items() if k != "reasoning_content"}
            assert list(after) == [k for k in before if k != "reasoning_content"]
        elif i in result.rewritten_indexes:
            assert after == {**before, "role": "user"}
        else:
            assert after == before


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_passthrough_sends_every_shape_unchanged(name):
    body = SHAPES[name]()
    result = DEEPSEEK.strip(DEEPSEEK.parse_request(body), StripOptions(passthrough=True))
    assert result.mode == "passthrough" and result.stripped_indexes == () and not result.nudge_rewritten
    out = DEEPSEEK.render_request(result.request)
    assert out == body and status(out) == EXPECTED[name].passthrough


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_without_the_nudge_rewrite_strict_shapes_go_unchanged(name):
    body = SHAPES[name]()
    assert status(sent(body, StripOptions(rewrite_nudge=False))) == EXPECTED[name].no_rewrite


def test_w3_is_fixed_by_the_rewrite_alone():
    body = SHAPES["W3"]()
    out = sent(body, StripOptions())
    assert [m["role"] for m in out["messages"]][-2:] == ["assistant", "user"]
    assert out["messages"][-1]["content"] == body["messages"][-1]["content"]
    assert status(body) == 400 and status(out) == 200


def test_stripped_report_counts_texts_and_bytes():
    body = SHAPES["V0"]()
    result = DEEPSEEK.strip(DEEPSEEK.parse_request(body), StripOptions())
    texts = tuple(body["messages"][i]["reasoning_content"] for i in (2, 4))
    assert result.stripped_texts == texts
    assert result.stripped_bytes == sum(len(t.encode()) for t in texts)
    assert result.stripped_opaque_bytes == 0


def test_keep_tool_turns_keeps_the_documented_reasoning():
    body = SHAPES["V0"]()
    result = DEEPSEEK.strip(DEEPSEEK.parse_request(body), StripOptions(keep_tool_turns=True))
    assert result.stripped_indexes == ()
    assert DEEPSEEK.render_request(result.request) == body
    w6 = SHAPES["W6"]()
    kept = DEEPSEEK.strip(DEEPSEEK.parse_request(w6), StripOptions(keep_tool_turns=True))
    assert kept.stripped_indexes == (4, 6)  # the answer and the draft; the calc turn keeps its own


def test_the_open_tool_chain_keeps_its_reasoning():
    body = SHAPES["V0"]()
    body["messages"] = body["messages"][:6]  # ends on the second tool result: the chain is open
    result = DEEPSEEK.strip(DEEPSEEK.parse_request(body), StripOptions())
    assert result.mode == "lenient" and result.stripped_indexes == ()
    assert DEEPSEEK.render_request(result.request) == body


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_strip_never_changes_its_input(name):
    body = SHAPES[name]()
    snapshot = copy.deepcopy(body)
    request = DEEPSEEK.parse_request(body)
    parsed = copy.deepcopy(request)
    for options in (StripOptions(), StripOptions(passthrough=True), StripOptions(keep_tool_turns=True),
                    StripOptions(rewrite_nudge=False)):
        DEEPSEEK.strip(request, options)
    assert request == parsed and body == snapshot
    assert DEEPSEEK.render_request(request) == snapshot


def test_content_null_and_empty_survive_stripping():
    for name, content in (("V3", None), ("V4", "")):
        body = SHAPES[name]()
        body["messages"][2]["reasoning_content"] = "restored"
        out = sent(body, StripOptions())
        assert "reasoning_content" not in out["messages"][2]
        assert "content" in out["messages"][2] and out["messages"][2]["content"] == content


def test_thinking_off_has_no_reasoning_rule():
    body = SHAPES["W2"]()
    body["thinking"] = {"type": "disabled"}
    assert DEEPSEEK.validate(body) is None
    del body["thinking"]
    assert DEEPSEEK.validate(body) is None
    body["model"] = "deepseek-reasoner"
    assert status(body) == 400


def test_reasoning_content_null_counts_as_missing():
    body = SHAPES["W6"]()
    body["messages"][2]["reasoning_content"] = None
    assert status(body) == 400
    assert DEEPSEEK.render_request(DEEPSEEK.parse_request(body)) == body
