"""The Gemini adapter, no HTTP: a body parses and renders back byte for byte
(thought parts, signatures on their parts, calls without ids, a turn without
a role), converts to the chat history the runtime steps, strips earlier
turns' thoughts with every signature kept on its part, and validates the
current turn's signatures as Gemini 3 does."""

from __future__ import annotations

import copy
import json

from session_runtime.protocols import StripOptions, get_protocol
from session_runtime.protocols.convert import to_chat
from session_runtime.protocols.gemini import camel_keys

GEMINI = get_protocol("gemini")
CHAT = get_protocol("openai-chat")

BODY = {
    "systemInstruction": {"parts": [{"text": "Be "}, {"text": "brief."}]},
    "contents": [
        {"role": "user", "parts": [{"text": "Weather?"}]},
        {"role": "model", "parts": [
            {"text": "need two cities", "thought": True, "thoughtSignature": "T1"},
            {"functionCall": {"id": "c1", "name": "weather", "args": {"city": "Paris"}}, "thoughtSignature": "S1"},
            {"functionCall": {"id": "c2", "name": "weather", "args": {"city": "Rome"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"id": "c2", "name": "weather", "response": {"t": 25}}},
                                   {"functionResponse": {"id": "c1", "name": "weather", "response": {"t": 21}}}]},
        {"role": "model", "parts": [{"text": "Both mild."}, {"text": "", "thoughtSignature": "S2"}]},
        {"parts": [{"text": "And Oslo?"}]},
        {"role": "model", "parts": [{"text": "one more", "thought": True},
                                    {"functionCall": {"name": "weather", "args": {"city": "Oslo"}},
                                     "thoughtSignature": "S3"}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "weather", "response": {"t": 3}}}]},
    ],
    "tools": [{"functionDeclarations": [{"name": "weather", "description": "The weather.", "parameters": {
        "type": "OBJECT", "properties": {"city": {"type": "STRING", "nullable": True}}, "required": ["city"]}}]}],
    "generationConfig": {"maxOutputTokens": 9, "temperature": 0.5, "topP": 0.9, "topK": 4},
}


def test_a_body_renders_back_byte_for_byte_and_is_not_changed():
    before = copy.deepcopy(BODY)
    req = GEMINI.parse_request(BODY)
    assert GEMINI.render_request(req) == BODY == before
    assert [m.role for m in req.messages] == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert req.messages[1].reasoning[0].text == "need two cities"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in req.messages[1].calls] == [
        ("c1", "weather", {"city": "Paris"}), ("c2", "weather", {"city": "Rome"})]


def test_the_chat_history_pairs_each_response_with_its_call():
    chat = CHAT.render_request(to_chat(GEMINI.parse_request(BODY), "gemini", "openai-chat"))
    messages = chat["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "user",
                                             "assistant", "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in messages if m["role"] == "tool"] == [
        ("c2", '{"t": 25}'), ("c1", '{"t": 21}'), ("call_5_0", '{"t": 3}')]  # no ids: the call's by its name
    assert messages[7]["tool_calls"][0]["id"] == "call_5_0" and messages[7]["reasoning_content"] == "one more"
    assert messages[5]["content"] == "Both mild."
    assert chat["tools"][0]["function"]["parameters"] == {
        "type": "object", "properties": {"city": {"type": ["string", "null"]}}, "required": ["city"]}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (9, 0.5, 0.9)


def test_strip_drops_earlier_thoughts_and_keeps_every_signature_on_its_part():
    result = GEMINI.strip(GEMINI.parse_request(BODY), StripOptions())
    sent = GEMINI.render_request(result.request)
    assert result.mode == "lenient" and result.stripped_indexes == (1,) and result.stripped_texts == ("need two cities",)
    first = sent["contents"][1]["parts"]
    # The thought part's own signature moves to the turn's first remaining part, which had one: kept as it was.
    assert first[0] == BODY["contents"][1]["parts"][1] and len(first) == 2
    assert sent["contents"][5] == BODY["contents"][5]  # the current turn goes whole
    assert GEMINI.strip(GEMINI.parse_request(BODY), StripOptions(context="all_turns")).stripped_indexes == ()


def test_validate_wants_a_signature_on_each_current_call_step_only():
    assert GEMINI.validate(BODY) is None
    unsigned = copy.deepcopy(BODY)
    del unsigned["contents"][5]["parts"][1]["thoughtSignature"]
    refusal = GEMINI.validate(unsigned)
    assert refusal.status == 400 and refusal.name == "gemini.thought_signature_missing"
    assert refusal.body["error"]["status"] == "INVALID_ARGUMENT" and "position 6" in refusal.body["error"]["message"]
    earlier = copy.deepcopy(BODY)
    del earlier["contents"][1]["parts"][1]["thoughtSignature"]  # an earlier turn: not checked
    assert GEMINI.validate(earlier) is None
    assert GEMINI.known_error(400, refusal.body) == "gemini.thought_signature_missing"


def test_snake_case_names_are_read_as_google_reads_them():
    body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}],
            "generation_config": {"max_output_tokens": 3, "thinking_config": {"include_thoughts": True}},
            "tools": [{"function_declarations": [{"name": "f", "parameters_json_schema": {
                "type": "object", "properties": {"snake_name": {"type": "string"}}}}]}]}
    assert camel_keys(body) == {
        "contents": body["contents"],
        "generationConfig": {"maxOutputTokens": 3, "thinkingConfig": {"includeThoughts": True}},
        "tools": [{"functionDeclarations": [{"name": "f", "parametersJsonSchema": {
            "type": "object", "properties": {"snake_name": {"type": "string"}}}}]}]}
