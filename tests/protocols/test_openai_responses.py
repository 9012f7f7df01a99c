"""OpenAI Responses: input and output items round-trip byte for byte
(encrypted_content included); the outbound rule; the 400s and the 404."""

from __future__ import annotations

import copy
import json

import pytest

from session_runtime.protocols import ProtocolInputError, StripOptions, get_protocol
from session_runtime.protocols.canonical import Call, Msg, Reasoning, Reply, Usage, reasoning_text
from session_runtime.protocols.responses_items import render_items

RESPONSES = get_protocol("openai-responses")

# PROTOCOLS.md section 2's example.
EXAMPLE = {"model": "gpt-5", "store": False, "include": ["reasoning.encrypted_content"],
           "input": [{"role": "user", "content": "Temp in Paris?"},
                     {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA…"},
                     {"type": "function_call", "call_id": "call_1", "name": "get_temp",
                      "arguments": "{\"city\":\"Paris\"}"},
                     {"type": "function_call_output", "call_id": "call_1", "output": "15"}]}

RS_1 = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "**Paris** needs the tool."}],
        "encrypted_content": "gAAAAABo1QmX" + "x" * 64, "status": None}
FC_1 = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_temp",
        "arguments": "{\"city\":\"Paris\"}", "status": "completed"}
RS_2 = {"id": "rs_2", "type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo2" + "y" * 64}
MSG_2 = {"id": "msg_2", "type": "message", "status": "completed", "content": [
    {"type": "output_text", "text": "15°C in Paris.", "annotations": [], "logprobs": []}], "role": "assistant"}
RS_3 = {"type": "reasoning", "id": "rs_3", "summary": [{"type": "summary_text", "text": "Now Rome."},
                                                        {"type": "summary_text", "text": "Call again."}],
        "encrypted_content": "gAAAAABo3" + "z" * 64}
PREAMBLE = {"type": "message", "id": "msg_3", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Checking Rome.", "annotations": []}]}
FC_3 = {"type": "function_call", "id": "fc_3", "call_id": "call_3", "name": "get_temp",
        "arguments": "{\"city\": \"Rome\"}", "status": "completed"}

# A stateless multi-turn tool chain as the SDK dumps output items back into input.
CHAIN = {
    "model": "gpt-5", "instructions": "You are a weather bot.", "store": False,
    "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "high", "summary": "auto"},
    "tools": [{"type": "function", "name": "get_temp", "description": "Temperature.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}],
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Temp in Paris?"}]},
        RS_1, FC_1, {"type": "function_call_output", "call_id": "call_1", "output": "15"},
        RS_2, MSG_2,
        {"role": "user", "content": "And Rome?"},
        RS_3, PREAMBLE, FC_3,
        {"type": "function_call_output", "call_id": "call_3", "output": [{"type": "input_text", "text": "21"}]},
    ],
    "max_output_tokens": 4000, "parallel_tool_calls": False,
}

RESPONSE = {
    "id": "resp_1", "object": "response", "created_at": 1741476542, "status": "completed", "error": None,
    "incomplete_details": None, "instructions": None, "max_output_tokens": None, "model": "gpt-5-2025-08-07",
    "output": [RS_3, PREAMBLE, FC_3], "parallel_tool_calls": True, "previous_response_id": None,
    "reasoning": {"effort": "high", "summary": "auto"}, "store": False, "temperature": 1.0,
    "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
    "usage": {"input_tokens": 328, "input_tokens_details": {"cached_tokens": 256}, "output_tokens": 52,
              "output_tokens_details": {"reasoning_tokens": 30}, "total_tokens": 380},
    "user": None, "metadata": {},
}


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("body", [
    EXAMPLE, CHAIN,
    {"model": "gpt-5", "input": "Hello"},
    {"model": "gpt-5", "previous_response_id": "resp_0", "input": [
        {"type": "item_reference", "id": "rs_0"}, {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"role": "assistant", "content": "plain text"}, {"role": "assistant", "content": "second message"},
        {"type": "custom_tool_call_output", "call_id": "c", "output": "x"}, {"role": "system", "content": ""}]},
    {"model": "gpt-5", "conversation": "conv_1"},
], ids=["example", "chain", "string", "odd_items", "no_input"])
def test_request_round_trip_is_byte_identical(body):
    snapshot = dumps(body)
    assert dumps(RESPONSES.render_request(RESPONSES.parse_request(copy.deepcopy(body)))) == snapshot


def test_turns_group_their_items():
    req = RESPONSES.parse_request(CHAIN)
    assert [m.role for m in req.messages] == ["developer", "user", "assistant", "tool", "assistant", "user",
                                              "assistant", "tool"]
    first, answer, chain = req.messages[2], req.messages[4], req.messages[6]
    assert first.layout == ("reasoning", "call") and first.calls == (Call("call_1", "get_temp", FC_1["arguments"],
                                                                          FC_1),)
    assert dumps(first.reasoning[0].opaque) == dumps(RS_1) and reasoning_text(first) == "**Paris** needs the tool."
    assert answer.content == MSG_2["content"] and answer.layout == ("reasoning", "message:1")
    assert chain.layout == ("reasoning", "message:1", "call") and reasoning_text(chain) == "Now Rome.\n\nCall again."
    assert req.messages[3].call_id == "call_1" and req.params["instructions"] == "You are a weather bot."


def test_strip_drops_earlier_turns_reasoning_and_their_item_ids():
    body = copy.deepcopy(CHAIN)
    result = RESPONSES.strip(RESPONSES.parse_request(body), StripOptions())
    out = RESPONSES.render_request(result.request)
    assert body == CHAIN
    assert result.mode == "lenient" and result.stripped_indexes == (2, 4)
    assert result.stripped_texts == ("**Paris** needs the tool.", "")
    assert result.stripped_opaque_bytes > 128
    assert out["input"][:6] == [
        CHAIN["input"][0], CHAIN["input"][1],
        {k: v for k, v in FC_1.items() if k != "id"}, CHAIN["input"][4],
        {k: v for k, v in MSG_2.items() if k != "id"}, CHAIN["input"][7]]
    assert dumps(out["input"][6:]) == dumps(CHAIN["input"][8:])  # the open chain, verbatim
    assert RESPONSES.validate(out) is None


def test_strip_options():
    req = RESPONSES.parse_request(CHAIN)
    for options in (StripOptions(passthrough=True), StripOptions(context="all_turns")):
        assert RESPONSES.render_request(RESPONSES.strip(req, options).request) == CHAIN
    asked = RESPONSES.parse_request({**CHAIN, "reasoning": {"effort": "high", "context": "all_turns"}})
    assert RESPONSES.strip(asked, StripOptions()).stripped_indexes == ()
    assert RESPONSES.strip(req, StripOptions(keep_tool_turns=True)).stripped_indexes == (4,)


def test_the_400s_and_the_404():
    assert RESPONSES.validate(EXAMPLE) is None and RESPONSES.validate(CHAIN) is None
    dropped = copy.deepcopy(CHAIN)
    del dropped["input"][2]  # rs_1 gone, fc_1 still carries its id
    error = RESPONSES.validate(dropped)
    assert (error.status, error.name) == (400, "openai-responses.reasoning_item_missing")
    assert error.body == {"error": {"message": "Item 'fc_1' of type 'function_call' was provided without its required "
                                               "'reasoning' item: 'rs_unknown'.", "type": "invalid_request_error",
                                    "param": "input", "code": None}}
    assert RESPONSES.known_error(400, error.body) == "openai-responses.reasoning_item_missing"
    dangling = {**EXAMPLE, "input": EXAMPLE["input"][:2]}
    error = RESPONSES.validate(dangling)
    assert (error.status, error.body["error"]["message"]) == (
        400, "Item 'rs_1' of type 'reasoning' was provided without its required following item.")
    assert RESPONSES.known_error(400, error.body) == "openai-responses.reasoning_without_following_item"
    by_id = copy.deepcopy(EXAMPLE)
    del by_id["input"][1]["encrypted_content"]
    error = RESPONSES.validate(by_id)
    assert (error.status, error.body["error"]["message"]) == (
        404, "Item with id 'rs_1' not found. Items are not persisted when `store` is set to false. Try again with "
             "`store` set to true, or remove this item from your input.")
    assert RESPONSES.known_error(404, error.body) == "openai-responses.item_not_found"
    assert RESPONSES.validate({**by_id, "store": True}) is None
    ref = {"model": "gpt-5", "store": False, "input": [{"type": "item_reference", "id": "msg_9"},
                                                       {"role": "user", "content": "hi"}]}
    assert RESPONSES.validate(ref).status == 404
    plain = {"model": "gpt-4.1", "input": [{"role": "user", "content": "a"}, {k: v for k, v in FC_1.items()},
                                           {"type": "function_call_output", "call_id": "call_1", "output": "1"}]}
    assert RESPONSES.validate(plain) is None  # no reasoning in this conversation


@pytest.mark.parametrize("mutate,path", [
    (lambda b: b.__setitem__("input", {"role": "user"}), "input"),
    (lambda b: b["input"].__setitem__(0, "hi"), "input[0]"),
    (lambda b: b["input"][0].__setitem__("role", "tool"), "input[0].role"),
    (lambda b: b["input"][2].__setitem__("arguments", {"city": "Paris"}), "input[2].arguments"),
    (lambda b: b["input"][3].pop("call_id"), "input[3].call_id"),
    (lambda b: b["input"][0].__setitem__("content", None), "input[0].content"),
])
def test_bad_input_names_its_path(mutate, path):
    body = copy.deepcopy(EXAMPLE)
    mutate(body)
    with pytest.raises(ProtocolInputError) as info:
        RESPONSES.parse_request(body)
    assert info.value.path == path
    error = RESPONSES.validate(body)
    assert error.status == 400 and error.body["error"]["param"] == path


def test_response_round_trip_and_usage():
    reply = RESPONSES.parse_response(copy.deepcopy(RESPONSE))
    assert dumps(RESPONSES.render_response(reply, RESPONSE["model"])) == dumps(RESPONSE)
    assert reply.finish_reason == "tool_calls" and reply.id == "resp_1"
    assert reply.message.content == PREAMBLE["content"] and reply.message.calls[0].id == "call_3"
    u = reply.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_input_tokens, u.reasoning_tokens) == (328, 52, 256, 30)
    cut = RESPONSES.parse_response({**RESPONSE, "status": "incomplete", "output": [RS_3],
                                    "incomplete_details": {"reason": "max_output_tokens"}})
    assert cut.finish_reason == "length" and cut.message.content is None
    with pytest.raises(ProtocolInputError):
        RESPONSES.parse_response({**RESPONSE, "output": [{"role": "user", "content": "x"}]})


def test_a_hand_built_reply_and_messages():
    msg = Msg("assistant", "Hi.", (Reasoning("why"),), (Call("call_1", "f", "{}"),))
    out = RESPONSES.render_response(Reply(msg, Usage(10, 3, None, 1), "tool_calls", "resp_9"), "gpt-5")
    assert out["object"] == "response" and out["status"] == "completed" and out["incomplete_details"] is None
    assert out["output"] == [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "why"}]},
        {"type": "message", "role": "assistant", "content": "Hi."},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    assert out["usage"] == {"input_tokens": 10, "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 1},
                            "total_tokens": 13}
    assert render_items(Msg("tool", "15", call_id="call_1")) == [
        {"type": "function_call_output", "call_id": "call_1", "output": "15"}]
    assert RESPONSES.parse_response(out).finish_reason == "tool_calls"
