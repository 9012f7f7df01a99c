"""The Gemini API (`/v1beta/models/{model}:...`) driven by Google's own SDK
(`google-genai`) over loopback HTTP, on a server of the tiny preset: two
turns of a stateless client are one inferred conversation, a stream is the
answer in chunks with running usage, a forced call carries this server's
thought signature and its result continues the turn, a current-turn call
sent back without its signature (or with another's) is refused as Gemini 3
refuses it, countTokens counts what generateContent renders, and every bad
input is Google's 400 (or 404) that changes nothing."""

from __future__ import annotations

import base64
import json

import httpx
import jsonschema
import pytest
from google import genai
from google.genai import errors, types

from tests.api.conftest import served
from tests.prometheus import parse as parse_samples

MODEL = "tiny"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [types.Tool(function_declarations=[
    types.FunctionDeclaration(name="get_weather", description="The weather in a city.",
                              parameters_json_schema=PARAMETERS),
    types.FunctionDeclaration(name="get_time", description="The time in a zone.", parameters=types.Schema(
        type="OBJECT", properties={"zone": types.Schema(type="INTEGER")}, required=["zone"]))])]


@pytest.fixture(scope="module")
def server():
    """A server of its own: a forced call's prompt and call outgrow the shared one's 512-token context."""
    with served(max_context=2048) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(server):
    return genai.Client(api_key="any", http_options=types.HttpOptions(base_url=server.url, timeout=120_000))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture
def rt(server):
    yield server.runtime
    server.runtime.check_integrity()


def user(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


def conversation_of(response) -> str:
    return response.sdk_http_response.headers["x-session-runtime-conversation"]


def inferred(rt, system: str) -> list:
    return [c for c in rt.conversations.values() if c.system == system]


def without_thoughts(content: types.Content) -> types.Content:
    """The model turn as Gemini CLI sends it back: its thought parts dropped."""
    return types.Content(role="model", parts=[p for p in content.parts if not p.thought])


def test_two_turns_of_a_stateless_client_are_one_inferred_conversation(sdk, http, rt):
    system = "[gemini] Two turns."
    config = types.GenerateContentConfig(system_instruction=system, max_output_tokens=12, temperature=0,
                                         thinking_config=types.ThinkingConfig(include_thoughts=True))
    first = sdk.models.generate_content(model=MODEL, contents=[user("Hello there")], config=config)
    parts = first.candidates[0].content.parts
    assert parts[0].thought and parts[0].text  # the reasoning, shown as a thought part
    assert first.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    usage = first.usage_metadata
    assert usage.thoughts_token_count + usage.candidates_token_count == 12
    assert usage.total_token_count == usage.prompt_token_count + 12
    history = [user("Hello there"), without_thoughts(first.candidates[0].content), user("And now?")]
    second = sdk.models.generate_content(model=MODEL, contents=history, config=config)
    cid = conversation_of(first)
    assert conversation_of(second) == cid
    assert second.usage_metadata.cached_content_token_count >= first.usage_metadata.prompt_token_count - 16
    listed = {c["id"]: c for c in http.get("/v1/conversations").json()["data"]}
    assert listed[cid]["inferred"] == "gemini" and listed[cid]["turns"] == 2
    # The same request again is a retry: the step replayed, no third turn.
    again = sdk.models.generate_content(model=MODEL, contents=history, config=config)
    assert conversation_of(again) == cid and again.text == second.text
    assert len(rt.get(cid).turns) == 2 and len(inferred(rt, system)) == 1


def test_a_stream_is_the_answer_in_chunks_with_running_usage(sdk, rt):
    system = "[gemini] Streamed."
    config = types.GenerateContentConfig(system_instruction=system, max_output_tokens=10, temperature=0,
                                         thinking_config=types.ThinkingConfig(include_thoughts=True))
    chunks = list(sdk.models.generate_content_stream(model=MODEL, contents=[user("Stream it")], config=config))
    assert len(chunks) >= 2
    thoughts = "".join(p.text for c in chunks[:-1] for p in c.candidates[0].content.parts if p.thought)
    text = "".join(p.text or "" for c in chunks for p in c.candidates[0].content.parts if not p.thought)
    last = chunks[-1]
    assert last.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])
    prompt = chunks[0].usage_metadata.prompt_token_count
    assert prompt > 0 and all(c.usage_metadata.prompt_token_count == prompt for c in chunks)
    assert last.usage_metadata.total_token_count == prompt + 10
    (conv,) = inferred(rt, system)
    step = rt.describe(conv.id)["turns"][0]["steps"][0]
    assert thoughts and step["output_tokens"] == 10
    answer = conv.trace_messages()[-1]
    assert (thoughts, text) == (answer.reasoning, answer.content or "")
    assert (step["prompt_tokens"], step["cached_input_tokens"]) == (prompt, chunks[0].usage_metadata.cached_content_token_count or 0)


def forced_config(system: str) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(
        system_instruction=system, max_output_tokens=160, temperature=0, tools=TOOLS,
        thinking_config=types.ThinkingConfig(thinking_budget=0),
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
            mode="ANY", allowed_function_names=["get_weather"])))


def forced_call(sdk, system: str):
    config = forced_config(system)
    response = sdk.models.generate_content(model=MODEL, contents=[user("Weather in Paris?")], config=config)
    (call,) = response.function_calls
    assert call.name == "get_weather"
    jsonschema.validate(call.args, PARAMETERS)
    part = response.candidates[0].content.parts[-1]
    assert part.function_call is not None and part.thought_signature  # on the (first) call's part
    return config, response


def results_turn(response, signature) -> list[types.Content]:
    """The history with the call's result, its part carrying `signature` (None: none)."""
    call = response.candidates[0].content.parts[-1]
    sent = types.Part(function_call=call.function_call, thought_signature=signature)
    result = types.Part(function_response=types.FunctionResponse(
        id=call.function_call.id, name=call.function_call.name, response={"temp": 21}))
    return [user("Weather in Paris?"), types.Content(role="model", parts=[sent]),
            types.Content(role="user", parts=[result])]


def test_a_forced_call_carries_a_signature_and_its_result_continues_the_turn(sdk, rt):
    system = "[gemini] Forced call."
    config, response = forced_call(sdk, system)
    cid = conversation_of(response)
    # Sent back as the SDK sends it (the signature's bytes in standard base64), the turn goes on.
    history = [user("Weather in Paris?"), response.candidates[0].content,
               results_turn(response, None)[2]]
    auto = config.model_copy(update={"tool_config": None, "max_output_tokens": 8})
    after = sdk.models.generate_content(model=MODEL, contents=history, config=auto)
    assert conversation_of(after) == cid
    turns = rt.describe(cid)["turns"]
    assert len(turns) == 1 and len(turns[0]["steps"]) == 2


def test_a_current_turn_call_without_this_servers_signature_is_refused(sdk, server, rt):
    system = "[gemini] Signatures."
    config, response = forced_call(sdk, system)
    cid = conversation_of(response)
    auto = config.model_copy(update={"tool_config": None, "max_output_tokens": 8})
    version = rt.get(cid).version
    for signature, words in ((None, "missing a thought_signature"), (b"not this server's", "Corrupted")):
        with pytest.raises(errors.ClientError) as refused:
            sdk.models.generate_content(model=MODEL, contents=results_turn(response, signature), config=auto)
        assert refused.value.code == 400 and refused.value.status == "INVALID_ARGUMENT"
        assert words in refused.value.message
        assert rt.get(cid).version == version  # nothing changed
    with httpx.Client(base_url=server.url) as c:
        before = parse_samples(c.get("/metrics").text)["session_runtime_gemini_signature_skips_total"]
    skip = sdk.models.generate_content(model=MODEL, contents=results_turn(
        response, b"skip_thought_signature_validator"), config=auto)
    assert conversation_of(skip) == cid and len(rt.describe(cid)["turns"][0]["steps"]) == 2
    with httpx.Client(base_url=server.url) as c:
        after = parse_samples(c.get("/metrics").text)["session_runtime_gemini_signature_skips_total"]
    assert after == before + 1


def test_count_tokens_counts_what_generate_content_renders(sdk):
    contents = [user("[gemini] Count these words, please.")]
    counted = sdk.models.count_tokens(model=MODEL, contents=contents)
    answered = sdk.models.generate_content(model=MODEL, contents=contents,
                                           config=types.GenerateContentConfig(max_output_tokens=1))
    assert counted.total_tokens == answered.usage_metadata.prompt_token_count > 0


BAD = [
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "frobnicate": 1}, "Unknown name \"frobnicate\""),
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"candidateCount": 2}},
     "candidateCount"),
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"topK": -1}}, "topK"),
    ({"contents": [{"role": "system", "parts": [{"text": "hi"}]}]}, "unknown role"),
    ({"contents": [{"role": "user", "parts": "hi"}]}, "parts"),
    ({"contents": []}, "contents is not specified"),
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]},
                   {"role": "model", "parts": [{"functionCall": {"name": "f", "args": [1]}}]}]}, "args"),
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
      "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}}, "mode"),
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
      "generationConfig": {"thinkingConfig": {"thinkingLevel": "extreme"}}}, "thinkingLevel"),
    ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
      "generationConfig": {"responseSchema": {"type": "OBJECT"}}}, "responseMimeType"),
    ({"contents": [{"role": "user", "parts": [{"text": 7}]}]}, "text"),
    ({"contents": [{"role": "user", "parts": [{"text": "look", "inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]},
     "contents[0].parts[0]: a part of text, inlineData"),
    ({"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]},
     "a part of inlineData is not supported"),
    ({"contents": [{"role": "user", "parts": [{"functionResponse": {"response": {}}}]}]}, "functionResponse.name"),
]


@pytest.mark.parametrize("body,words", BAD)
def test_bad_input_is_googles_400_and_changes_nothing(http, rt, body, words):
    count = len(rt.conversations)
    for method in ("generateContent", "streamGenerateContent?alt=sse"):
        r = http.post(f"/v1beta/models/{MODEL}:{method}", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"code", "message", "status"} and error["status"] == "INVALID_ARGUMENT"
        assert words in error["message"], error
    assert len(rt.conversations) == count


def test_unknown_models_methods_and_bodies(http):
    body = {"contents": [{"parts": [{"text": "hi"}]}]}
    r = http.post("/v1beta/models/gemini-3-pro:generateContent", json=body)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    r = http.post(f"/v1beta/models/{MODEL}:embedContent", json=body)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    r = http.post(f"/v1beta/models/{MODEL}:generateContent", content=b"{not json",
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_signatures_are_url_safe_and_accepted_in_either_alphabet(server):
    from session_runtime.api.gemini_route import verified
    from session_runtime.api.gemini_stream import call_signature

    secret = server.app.state.secret
    for k in range(64):  # enough arguments that some signature holds - or _
        args = {"k": k}
        signature = call_signature(secret, "f", args)
        assert "+" not in signature and "/" not in signature and "=" not in signature
        standard = base64.b64encode(base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))).decode()
        assert verified(secret, signature, "f", args) and verified(secret, standard, "f", args)
        assert not verified(secret, signature, "f", {"k": k + 1}) and not verified(secret, signature, "g", args)
    assert json.dumps(args)  # a plain object


def test_validate_gemini_answers_as_geminis_validator():
    """`--validate gemini`: any model name; a current-turn call needs a
    signature (anyone's: the validator cannot read Google's), refused in
    Gemini's words and named in x-session-runtime-validator; earlier turns'
    calls need none."""
    from session_runtime.api.settings import ApiSettings

    call = {"functionCall": {"id": "c1", "name": "get_time", "args": {"zone": 3}}}
    result = {"role": "user", "parts": [{"functionResponse": {"id": "c1", "name": "get_time", "response": {"t": 1}}}]}
    tools = [{"functionDeclarations": [{"name": "get_time", "parametersJsonSchema": {
        "type": "object", "properties": {"zone": {"type": "integer"}}}}]}]

    def body(signature, earlier=False):
        part = {**call, **({"thoughtSignature": signature} if signature else {})}
        turns = [{"role": "user", "parts": [{"text": "[gemini-validate] What time?"}]},
                 {"role": "model", "parts": [part]}, result]
        if earlier:
            turns += [{"role": "model", "parts": [{"text": "3 o'clock."}]}, {"role": "user", "parts": [{"text": "ok"}]}]
        return {"contents": turns, "tools": tools, "generationConfig": {"maxOutputTokens": 2}}

    with served(ApiSettings(validate="gemini"), max_context=2048) as live, httpx.Client(base_url=live.url,
                                                                                        timeout=120) as c:
        url = "/v1beta/models/gemini-3-pro-preview:generateContent"
        r = c.post(url, json=body(None))
        assert r.status_code == 400 and r.headers["x-session-runtime-validator"] == "gemini.thought_signature_missing"
        assert r.json()["error"]["status"] == "INVALID_ARGUMENT"
        assert "Function call is missing a thought_signature" in r.json()["error"]["message"]
        assert len(live.runtime.conversations) == 0
        assert c.post(url, json=body("Q2hpY2tlbg==")).status_code == 200
        assert c.post(url, json=body(None, earlier=True)).status_code == 200


def test_mode_none_and_stop_sequences(sdk, rt):
    """toolConfig NONE: no call, the tools still in the prompt; stopSequences
    end the answer before the sequence, which is never sent."""
    base = dict(max_output_tokens=24, temperature=0, thinking_config=types.ThinkingConfig(thinking_budget=0))
    free = sdk.models.generate_content(model=MODEL, contents=[user("[gemini] Stop somewhere.")],
                                       config=types.GenerateContentConfig(**base))
    text = free.text or ""
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = sdk.models.generate_content(model=MODEL, contents=[user("[gemini] Stop somewhere.")],
                                      config=types.GenerateContentConfig(**base, stop_sequences=[stop]))
    assert (cut.text or "") == text[:text.index(stop)]
    assert cut.candidates[0].finish_reason == types.FinishReason.STOP
    none = sdk.models.generate_content(model=MODEL, contents=[user("[gemini] No calls.")], config=types.GenerateContentConfig(
        **base, tools=TOOLS, tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(mode="NONE"))))
    assert not none.function_calls
    offered = sdk.models.count_tokens(model=MODEL, contents=[user("[gemini] No calls.")])
    assert none.usage_metadata.prompt_token_count > offered.total_tokens + 20  # the tools are in the prompt
