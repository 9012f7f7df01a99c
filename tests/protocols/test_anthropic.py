"""Anthropic Messages: round trips with thinking, redacted thinking and
interleaved blocks byte-identical; the outbound rule; the thinking refusals."""

from __future__ import annotations

import copy
import json

import pytest

from session_runtime.protocols import ProtocolInputError, StripOptions, get_protocol
from session_runtime.protocols.base import compact
from session_runtime.protocols.canonical import Call, Msg, Reasoning, Reply, Usage, reasoning_text

ANTHROPIC = get_protocol("anthropic")

THINK_1 = {"type": "thinking", "thinking": "Need weather…", "signature": "EqQBCkgIARABGAIiQL2x…"}
TOOL_1 = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"location": "Paris", "unit": "c"}}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"}
THINK_2 = {"type": "thinking", "thinking": "Now Rome.", "signature": "ErUBCkYIBRgCIkD8…=="}
TOOL_2 = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"unit": "c", "location": "Rome"},
          "cache_control": {"type": "ephemeral"}}

# PROTOCOLS.md section 3's example, after a closed earlier turn, with interleaved
# thinking (thinking, tool_use, redacted, thinking, tool_use, text) in the open chain.
TOOL_CHAIN = {
    "model": "claude-sonnet-4-5", "max_tokens": 16000,
    "thinking": {"type": "enabled", "budget_tokens": 10000},
    "system": [{"type": "text", "text": "You are a weather bot.", "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "get_weather", "description": "Weather by city.",
               "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}}}],
    "messages": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": "Sig0"},
                                          {"type": "text", "text": "Hello! How can I help?"}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": "iVBORw0KGgo="}}]},
        {"role": "assistant", "content": [THINK_1, TOOL_1, REDACTED, THINK_2, TOOL_2,
                                          {"type": "text", "text": "Checking both."}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "15°C"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": [{"type": "text", "text": "21°C"}], "is_error": False}]},
    ],
}

RESPONSE = {
    "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
    "content": [{"type": "thinking", "thinking": "Both known.", "signature": "EuYBCkQYAiJA…"},
                {"type": "text", "text": "Paris 15°C, Rome 21°C.", "citations": None}],
    "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 50, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 1000,
              "output_tokens": 80, "service_tier": "standard"},
}


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def fresh() -> dict:
    return copy.deepcopy(TOOL_CHAIN)


def test_request_round_trip_is_byte_identical():
    body = fresh()
    assert dumps(ANTHROPIC.render_request(ANTHROPIC.parse_request(body))) == dumps(TOOL_CHAIN)
    assert body == TOOL_CHAIN


def test_interleaved_blocks_parse_in_order_with_state_verbatim():
    m = ANTHROPIC.parse_request(fresh()).messages[3]
    assert m.layout == ("reasoning", "call", "reasoning", "reasoning", "call", "content")
    assert [dumps(r.opaque) for r in m.reasoning] == [dumps(THINK_1), dumps(REDACTED), dumps(THINK_2)]
    assert reasoning_text(m) == "Need weather…\n\nNow Rome."
    assert m.calls[1] == Call("toolu_2", "get_weather", '{"unit": "c", "location": "Rome"}', TOOL_2)
    assert m.content == [{"type": "text", "text": "Checking both."}]
    user = ANTHROPIC.parse_request(fresh()).messages[4]
    assert user.role == "user" and user.content == TOOL_CHAIN["messages"][4]["content"]


def test_strip_drops_closed_turns_thinking_and_echoes_the_chain():
    req = ANTHROPIC.parse_request(fresh())
    result = ANTHROPIC.strip(req, StripOptions())
    out = ANTHROPIC.render_request(result.request)
    assert result.mode == "lenient" and result.stripped_indexes == (1,)
    assert result.stripped_texts == ("Greet back.",)
    assert result.stripped_opaque_bytes == len(compact(TOOL_CHAIN["messages"][1]["content"][0]).encode())
    assert out["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]}
    assert dumps(out["messages"][3:]) == dumps(TOOL_CHAIN["messages"][3:])
    assert {k: v for k, v in out.items() if k != "messages"} == {k: v for k, v in TOOL_CHAIN.items() if k != "messages"}
    assert ANTHROPIC.validate(out) is None


def test_strip_options():
    req = ANTHROPIC.parse_request(fresh())
    assert ANTHROPIC.render_request(ANTHROPIC.strip(req, StripOptions(passthrough=True)).request) == TOOL_CHAIN
    kept = ANTHROPIC.strip(req, StripOptions(context="all_turns"))
    assert kept.stripped_indexes == () and ANTHROPIC.render_request(kept.request) == TOOL_CHAIN
    # a new user turn closes the chain: the interleaved turn loses all three reasoning blocks
    body = fresh()
    body["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "Paris 15, Rome 21."}]},
                         {"role": "user", "content": "Thanks"}]
    closed = ANTHROPIC.strip(ANTHROPIC.parse_request(body), StripOptions())
    assert closed.stripped_indexes == (1, 3)
    assert ANTHROPIC.render_request(closed.request)["messages"][3]["content"] == [
        TOOL_1, TOOL_2, {"type": "text", "text": "Checking both."}]
    tools = ANTHROPIC.strip(ANTHROPIC.parse_request(body), StripOptions(keep_tool_turns=True))
    assert tools.stripped_indexes == (1,)
    assert body["messages"][3]["content"][0] == THINK_1  # the input is never changed


def test_a_thinking_only_turn_is_not_emptied():
    body = {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [REDACTED]}, {"role": "user", "content": "b"}]}
    result = ANTHROPIC.strip(ANTHROPIC.parse_request(body), StripOptions())
    assert result.stripped_indexes == () and ANTHROPIC.render_request(result.request) == body


def test_thinking_required_before_the_final_tool_results():
    body = fresh()
    body["messages"][3]["content"] = [TOOL_1, TOOL_2]
    error = ANTHROPIC.validate(body)
    assert error.status == 400 and error.name == "anthropic.thinking_block_required"
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
    assert error.body["error"]["message"].startswith(
        "messages.3.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`. When `thinking` "
        "is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of "
        "`tool_use` and `tool_result` blocks).")
    assert ANTHROPIC.known_error(400, error.body) == "anthropic.thinking_block_required"
    body["messages"][3]["content"] = [REDACTED, TOOL_1, TOOL_2]
    assert ANTHROPIC.validate(body) is None
    body["thinking"] = {"type": "disabled"}
    assert ANTHROPIC.validate(body) is None


def test_thinking_in_a_final_assistant_when_disabled():
    body = fresh()
    del body["thinking"]
    body["messages"] = body["messages"][:2]
    error = ANTHROPIC.validate(body)
    assert error.status == 400 and error.name == "anthropic.thinking_when_disabled"
    assert error.body["error"]["message"] == (
        "messages.1.content.0: When thinking is disabled, an `assistant` message in the final position cannot "
        "contain `thinking`. To use thinking blocks, enable `thinking` in your request.")
    assert ANTHROPIC.known_error(400, error.body) == "anthropic.thinking_when_disabled"
    body["thinking"] = {"type": "adaptive"}
    assert ANTHROPIC.validate(body) is None


@pytest.mark.parametrize("mutate,path", [
    (lambda b: b["messages"].__setitem__(0, {"role": "system", "content": "x"}), "messages[0].role"),
    (lambda b: b["messages"][3]["content"][0].pop("thinking"), "messages[3].content[0].thinking"),
    (lambda b: b["messages"][3]["content"][1].__setitem__("input", "[]"), "messages[3].content[1].input"),
    (lambda b: b["messages"][3].__setitem__("content", 5), "messages[3].content"),
])
def test_bad_input_names_its_path(mutate, path):
    body = fresh()
    mutate(body)
    with pytest.raises(ProtocolInputError) as info:
        ANTHROPIC.parse_request(body)
    assert info.value.path == path
    error = ANTHROPIC.validate(body)
    assert error.status == 400 and error.body["error"]["message"].startswith(path.replace("[", ".").replace("]", ""))


def test_known_errors():
    def body(text):
        return {"type": "error", "error": {"type": "invalid_request_error", "message": text}}
    assert ANTHROPIC.known_error(400, body("messages.1.content.0: Invalid `signature` in `thinking` block")) == \
        "anthropic.invalid_signature"
    assert ANTHROPIC.known_error(400, body("The content[].thinking in the thinking mode must be passed back to "
                                           "the API.")) == "anthropic.thinking_missing"
    assert ANTHROPIC.known_error(400, body("max_tokens: Field required")) is None
    assert ANTHROPIC.known_error(529, body("Invalid `signature` in `thinking` block")) is None


def test_response_round_trip_and_usage():
    reply = ANTHROPIC.parse_response(copy.deepcopy(RESPONSE))
    assert dumps(ANTHROPIC.render_response(reply, RESPONSE["model"])) == dumps(RESPONSE)
    assert reply.finish_reason == "stop" and reply.extra["stop_reason"] == "end_turn"
    assert reasoning_text(reply.message) == "Both known."
    assert reply.message.content == [{"type": "text", "text": "Paris 15°C, Rome 21°C.", "citations": None}]
    u = reply.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_input_tokens, u.reasoning_tokens) == (1070, 80, 1000, None)
    assert ANTHROPIC.parse_response({**RESPONSE, "usage": {"input_tokens": 5, "output_tokens": 1}}).usage == Usage(
        5, 1, None, None, raw={"input_tokens": 5, "output_tokens": 1})


def test_a_hand_built_reply():
    msg = Msg("assistant", "Calling.", (Reasoning("t", THINK_1),), (Call("toolu_9", "f", '{"a": 1}'),))
    out = ANTHROPIC.render_response(Reply(msg, Usage(100, 5, 60, None), "tool_calls", "msg_1"), "claude")
    assert out == {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
                   "content": [THINK_1, {"type": "text", "text": "Calling."},
                               {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {"a": 1}}],
                   "stop_reason": "tool_use", "stop_sequence": None,
                   "usage": {"input_tokens": 40, "output_tokens": 5, "cache_read_input_tokens": 60}}
