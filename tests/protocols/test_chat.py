"""DeepSeek and OpenAI-compatible Chat Completions: round trips of request and
response bodies, byte-identical; bad input named by its JSON path; usage."""

from __future__ import annotations

import json

import pytest

from session_runtime.protocols import ProtocolInputError, StripOptions, get_protocol
from session_runtime.protocols.canonical import Call, Msg, Reasoning, Reply, Usage, reasoning_text

DEEPSEEK = get_protocol("deepseek")
CHAT = get_protocol("openai-chat")

CALC = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\":\"2+2\"}"}}

# PROTOCOLS.md section 1's example, in a multi-step tool chain with parallel calls.
TOOL_CHAIN = {
    "model": "deepseek-v4-flash", "thinking": {"type": "enabled"}, "stream": False, "max_tokens": 2048,
    "messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "What is 2+2, and the weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need 2+2 → call calc", "tool_calls": [CALC]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "index": 0,
             "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_3", "type": "function", "index": 1,
             "function": {"name": "weather", "arguments": "{\"city\":\"Rome\",  \"unit\":\"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "15"},
        {"role": "tool", "tool_call_id": "call_3", "content": [{"type": "text", "text": "21"}]},
    ],
    "tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}},
              {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
}

# An openai SDK `ChatCompletionMessage.model_dump()` history, with vLLM's `reasoning`.
SDK_DUMP = {
    "model": "Qwen/Qwen3-8B", "temperature": 0.6, "tools": None,
    "messages": [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Look:"},
                                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"content": "It is a cat.", "refusal": None, "role": "assistant", "annotations": [], "audio": None,
         "function_call": None, "tool_calls": None, "reasoning": "A cat, clearly.", "reasoning_content": "A cat, clearly."},
        {"role": "user", "content": "Sure?"},
        {"content": None, "refusal": "I can't say.", "role": "assistant", "annotations": [
            {"type": "url_citation", "url_citation": {"url": "https://example.com", "start_index": 0, "end_index": 1}}],
         "audio": {"id": "audio_1"}, "tool_calls": [], "reasoning": None, "reasoning_content": "Different text."},
        {"role": "user", "content": "Ok."},
        {"role": "assistant", "content": "", "reasoning": "only reasoning"},
    ],
    "chat_template_kwargs": {"enable_thinking": True},
}

DEEPSEEK_RESPONSE = {
    "id": "930c60df-bf64-41c9-a88e-3ec75f81e00e", "object": "chat.completion", "created": 1740000000,
    "model": "deepseek-v4-flash",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "reasoning_content": "Need calc.",
                                         "tool_calls": [CALC]}, "logprobs": None, "finish_reason": "tool_calls"}],
    "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
              "prompt_tokens_details": {"cached_tokens": 64}, "completion_tokens_details": {"reasoning_tokens": 12},
              "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 56},
    "system_fingerprint": "fp_abc",
}

VLLM_RESPONSE = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "Qwen/Qwen3-8B",
    "choices": [{"index": 0, "message": {"role": "assistant", "reasoning": "Think.", "content": "Done.",
                                         "tool_calls": [], "refusal": None},
                 "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
    "usage": {"prompt_tokens": 10, "total_tokens": 15, "completion_tokens": 5, "prompt_tokens_details": None},
    "prompt_logprobs": None, "kv_transfer_params": None,
}


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("proto", [DEEPSEEK, CHAT], ids=lambda p: p.name)
@pytest.mark.parametrize("body", [TOOL_CHAIN, SDK_DUMP], ids=["tool_chain", "sdk_dump"])
def test_request_round_trip_is_byte_identical(proto, body):
    if proto is DEEPSEEK and body is SDK_DUMP:
        body = {**body, "messages": body["messages"][:-1]}  # `reasoning` alone is not DeepSeek's reasoning
    snapshot = dumps(body)
    request = proto.parse_request(body)
    assert dumps(proto.render_request(request)) == snapshot
    assert dumps(body) == snapshot


def test_parsed_fields():
    req = DEEPSEEK.parse_request(TOOL_CHAIN)
    m = req.messages[2]
    assert (m.role, m.content, m.reasoning, m.call_id) == ("assistant", None, (Reasoning("Need 2+2 → call calc"),), None)
    assert m.calls == (Call("call_1", "calc", "{\"expr\":\"2+2\"}", CALC),)
    assert req.messages[4].reasoning == (Reasoning(""),) and req.messages[4].content == ""
    assert req.messages[0].reasoning is None
    assert req.messages[3].call_id == "call_1"
    assert req.params == {"model": "deepseek-v4-flash", "thinking": {"type": "enabled"}, "stream": False,
                          "max_tokens": 2048}
    assert len(req.tools) == 2


def test_openai_chat_reads_both_reasoning_fields():
    req = CHAT.parse_request(SDK_DUMP)
    assert reasoning_text(req.messages[2]) == "A cat, clearly."
    assert req.messages[2].extra == {"refusal": None, "annotations": [], "audio": None, "function_call": None,
                                     "tool_calls": None}
    assert reasoning_text(req.messages[4]) == "Different text." and req.messages[4].extra["reasoning"] is None
    assert reasoning_text(req.messages[6]) == "only reasoning"
    assert req.params["tools"] is None and req.tools == ()


def test_openai_chat_strip_drops_both_fields_before_the_last_user():
    body = {"model": "m", "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "x", "reasoning": "r1", "reasoning_content": "r2"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "y", "reasoning": "open chain"}]}
    result = CHAT.strip(CHAT.parse_request(body), StripOptions())
    out = CHAT.render_request(result.request)
    assert out["messages"][1] == {"role": "assistant", "content": "x"}
    assert out["messages"][3] == body["messages"][3]
    assert result.stripped_indexes == (1,) and result.mode == "lenient"


def test_hand_built_messages_render_in_the_default_layout():
    msg = Msg("assistant", None, (Reasoning("why"),), (Call("c", "f", "{}"),))
    assert DEEPSEEK.render_message(msg) == {"role": "assistant", "content": None, "reasoning_content": "why",
                                            "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": "{}"}}]}
    assert CHAT.render_message(Msg("tool", "4", call_id="c")) == {"role": "tool", "content": "4", "tool_call_id": "c"}


def test_an_edited_call_overwrites_only_its_fields():
    req = DEEPSEEK.parse_request(TOOL_CHAIN)
    call = req.messages[4].calls[0]
    edited = Call(call.id, call.name, "{}", call.opaque)
    out = DEEPSEEK.render_message(Msg("assistant", "", calls=(edited,)))
    assert out["tool_calls"][0] == {**TOOL_CHAIN["messages"][4]["tool_calls"][0],
                                    "function": {"name": "weather", "arguments": "{}"}}


@pytest.mark.parametrize("proto,body", [(DEEPSEEK, DEEPSEEK_RESPONSE), (CHAT, VLLM_RESPONSE)], ids=["deepseek", "vllm"])
def test_response_round_trip(proto, body):
    reply = proto.parse_response(body)
    assert dumps(proto.render_response(reply, body["model"])) == dumps(body)


def test_usage_mapping():
    ds = DEEPSEEK.parse_response(DEEPSEEK_RESPONSE)
    assert (ds.usage.prompt_tokens, ds.usage.completion_tokens, ds.usage.cached_input_tokens,
            ds.usage.reasoning_tokens) == (120, 30, 64, 12)
    assert ds.finish_reason == "tool_calls" and ds.id == DEEPSEEK_RESPONSE["id"]
    vllm = CHAT.parse_response(VLLM_RESPONSE)
    assert (vllm.usage.cached_input_tokens, vllm.usage.reasoning_tokens) == (None, None)
    assert reasoning_text(vllm.message) == "Think." and vllm.message.content == "Done."
    only_hit = {**DEEPSEEK_RESPONSE, "usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_cache_hit_tokens": 3}}
    assert DEEPSEEK.parse_response(only_hit).usage.cached_input_tokens == 3


def test_a_hand_built_reply_renders_a_chat_completion():
    reply = Reply(Msg("assistant", "hi", (Reasoning("r"),)), Usage(10, 2, 4, None), "stop", "x")
    out = DEEPSEEK.render_response(reply, "deepseek-v4-flash")
    assert out["object"] == "chat.completion" and isinstance(out["created"], int)
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": "r"},
                               "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                            "prompt_cache_hit_tokens": 4, "prompt_cache_miss_tokens": 6}
    assert CHAT.render_response(reply, "m")["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert DEEPSEEK.parse_response(out).usage == Usage(10, 2, 4, None, raw=out["usage"])


@pytest.mark.parametrize("mutate,path", [
    (lambda b: b.pop("messages"), "messages"),
    (lambda b: b.__setitem__("messages", {}), "messages"),
    (lambda b: b["messages"].__setitem__(1, "hi"), "messages[1]"),
    (lambda b: b["messages"][1].__setitem__("role", "function"), "messages[1].role"),
    (lambda b: b["messages"][1].__setitem__("content", 3), "messages[1].content"),
    (lambda b: b["messages"][2].__setitem__("reasoning_content", ["x"]), "messages[2].reasoning_content"),
    (lambda b: b["messages"][2].__setitem__("tool_calls", {}), "messages[2].tool_calls"),
    (lambda b: b["messages"][4]["tool_calls"][0]["function"].__setitem__("arguments", {"city": "Paris"}),
     "messages[4].tool_calls[0].function.arguments"),
    (lambda b: b["messages"][4]["tool_calls"][1].pop("id"), "messages[4].tool_calls[1].id"),
    (lambda b: b["messages"][3].__setitem__("tool_call_id", 1), "messages[3].tool_call_id"),
])
def test_bad_input_names_its_path(mutate, path):
    body = json.loads(json.dumps(TOOL_CHAIN))
    mutate(body)
    with pytest.raises(ProtocolInputError) as info:
        DEEPSEEK.parse_request(body)
    assert info.value.path == path and str(info.value).startswith(path + ": ")
    error = DEEPSEEK.validate(body)
    assert error.status == 400 and error.body["error"]["param"] == path
    assert error.body["error"]["type"] == "invalid_request_error"


def test_basic_shape_refusals():
    assert DEEPSEEK.validate(TOOL_CHAIN) is None and CHAT.validate(SDK_DUMP) is None
    assert DEEPSEEK.validate({"model": "m", "messages": []}).name == "deepseek.invalid_request"
    orphan = {"model": "m", "messages": [{"role": "user", "content": "a"},
                                          {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}
    assert DEEPSEEK.validate(orphan).name == "deepseek.tool_message_orphan"
    assert CHAT.validate(orphan).name == "openai-chat.tool_message_orphan"
    no_id = {"model": "m", "messages": [TOOL_CHAIN["messages"][2], {"role": "tool", "content": "x"}]}
    assert CHAT.validate(no_id).name == "openai-chat.tool_call_id_missing"
    developer = {"model": "m", "messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]}
    assert CHAT.validate(developer) is None
    error = DEEPSEEK.validate(developer)
    assert error.status == 400 and "unknown variant `developer`" in error.body["error"]["message"]


def test_known_errors():
    v32 = {"error": {"message": "Missing `reasoning_content` field in the assistant message at message index 46. For "
                                "more information, please refer to https://api-docs.deepseek.com/guides/thinking_mode"
                                "#tool-calls", "type": "invalid_request_error", "param": None,
                     "code": "invalid_request_error"}}
    assert DEEPSEEK.known_error(400, v32) == "deepseek.reasoning_content_missing"
    plain = {"error": {"message": "The reasoning_content in the thinking mode must be passed back to the API"}}
    assert DEEPSEEK.known_error(400, plain) == "deepseek.reasoning_content_missing"
    anth = {"type": "error", "error": {"type": "invalid_request_error", "message":
                                       "The content[].thinking in the thinking mode must be passed back to the API."}}
    assert DEEPSEEK.known_error(400, anth) == "deepseek.thinking_missing"
    assert DEEPSEEK.known_error(500, v32) is None and DEEPSEEK.known_error(400, {"error": "other"}) is None
    assert CHAT.known_error(400, v32) is None


def test_unknown_protocol():
    with pytest.raises(ValueError, match="unknown protocol"):
        get_protocol("bard")


def test_passthrough_from_env(monkeypatch):
    from session_runtime.protocols import PASSTHROUGH_ENV, passthrough_from_env

    assert PASSTHROUGH_ENV == "SESSION_RUNTIME_REASONING_PASSTHROUGH"
    assert passthrough_from_env({PASSTHROUGH_ENV: "1"}) and not passthrough_from_env({PASSTHROUGH_ENV: "0"})
    monkeypatch.setenv(PASSTHROUGH_ENV, "1")
    assert passthrough_from_env()
    monkeypatch.delenv(PASSTHROUGH_ENV)
    assert not passthrough_from_env()


def test_every_protocol_by_name():
    from session_runtime.protocols import NAMES, ChatProtocol

    assert NAMES == ("deepseek", "openai-chat", "openai-responses", "anthropic", "gemini")
    for name in NAMES:
        proto = get_protocol(name)
        assert isinstance(proto, ChatProtocol) and proto.name == name
