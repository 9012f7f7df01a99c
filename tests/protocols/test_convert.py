"""Another protocol's history rendered in DeepSeek's (or an OpenAI-compatible
server's) form."""

from __future__ import annotations

import pytest

from session_runtime.protocols import StripOptions, get_protocol
from session_runtime.protocols.canonical import Msg, Reasoning
from session_runtime.protocols.convert import to_chat
from tests.protocols import test_anthropic, test_chat, test_openai_responses

DEEPSEEK = get_protocol("deepseek")
CHAT = get_protocol("openai-chat")


def test_openai_chat_and_deepseek_convert_both_ways():
    req = CHAT.parse_request(test_chat.SDK_DUMP)
    out = DEEPSEEK.render_request(to_chat(req, "openai-chat", "deepseek"))
    assert out["messages"][0] == {"role": "system", "content": "Be terse."}
    assert out["messages"][2] == {k: v for k, v in test_chat.SDK_DUMP["messages"][2].items() if k != "reasoning"}
    assert list(out["messages"][6]) == ["role", "content", "reasoning_content"]
    assert out["messages"][6]["reasoning_content"] == "only reasoning"
    assert "reasoning" not in out["messages"][4] and out["messages"][4]["reasoning_content"] == "Different text."
    ds = DEEPSEEK.parse_request(test_chat.TOOL_CHAIN)
    assert to_chat(ds, "deepseek", "openai-chat") is ds and to_chat(ds, "deepseek") == ds


def test_anthropic_history_in_deepseek_form():
    req = get_protocol("anthropic").parse_request(test_anthropic.TOOL_CHAIN)
    out = DEEPSEEK.render_request(to_chat(req, "anthropic"))
    assert out["model"] == "claude-sonnet-4-5" and out["max_tokens"] == 16000
    assert out["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather by city.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}]
    assert out["messages"] == [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "Greet back."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Need weather…\n\nNow Rome.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"location": "Paris", "unit": "c"}'}},
                        {"id": "toolu_2", "type": "function", "function": {
                            "name": "get_weather", "arguments": '{"unit": "c", "location": "Rome"}'}}]},
        {"role": "tool", "content": "15°C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "21°C", "tool_call_id": "toolu_2"},
    ]
    assert DEEPSEEK.validate({**out, "thinking": {"type": "enabled"}}) is None
    stripped = DEEPSEEK.strip(DEEPSEEK.parse_request(out), StripOptions())
    assert stripped.stripped_indexes == (2,)


def test_responses_history_in_deepseek_form():
    req = get_protocol("openai-responses").parse_request(test_openai_responses.CHAIN)
    out = DEEPSEEK.render_request(to_chat(req, "openai-responses"))
    assert out["max_tokens"] == 4000 and out["tools"][0]["function"]["name"] == "get_temp"
    assert [(m["role"], m.get("content"), m.get("reasoning_content")) for m in out["messages"]] == [
        ("system", "You are a weather bot.", None), ("system", "Be terse.", None), ("user", "Temp in Paris?", None),
        ("assistant", None, "**Paris** needs the tool."), ("tool", "15", None),
        ("assistant", "15°C in Paris.", ""), ("user", "And Rome?", None),
        ("assistant", "Checking Rome.", "Now Rome.\n\nCall again."), ("tool", "21", None)]
    assert out["messages"][3]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_temp", "arguments": '{"city":"Paris"}'}}]
    assert DEEPSEEK.validate(out) is None
    chat = to_chat(req, "openai-responses", "openai-chat")
    assert chat.messages[1].role == "developer"


def test_unknown_names():
    req = DEEPSEEK.parse_request(test_chat.TOOL_CHAIN)
    with pytest.raises(ValueError):
        to_chat(req, "deepseek", "anthropic")
    with pytest.raises(ValueError):
        to_chat(req, "bard")


def test_a_hand_built_message_keeps_absent_reasoning_absent():
    req = get_protocol("anthropic").parse_request({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    assert to_chat(req, "anthropic").messages[1] == Msg("assistant", "b")
    redacted = Msg("assistant", [], (Reasoning("", {"type": "redacted_thinking", "data": "x"}),))
    assert DEEPSEEK.render_message(to_chat(req.__class__((redacted,)), "anthropic").messages[0]) == {
        "role": "assistant", "content": None, "reasoning_content": ""}
