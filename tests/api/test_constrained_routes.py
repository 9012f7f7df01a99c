"""Constrained output on every route, through the official SDKs over the
a server of the tiny preset (random weights, context 2048):
a forced tool call whose arguments validate against the tool's schema and
whose result continues the same chain, a JSON-schema answer that validates,
stop sequences that end the output (never sent, streamed or not), and bad
constraints refused with the protocol's 400 naming the field, nothing stored.

The random model's reasoning never closes by itself; the step's guard closes
it at the reasoning budget (a quarter of the output cap at effort low, else
Anthropic's budget_tokens) and the grammar writes the call or the answer after
it, so every output here is the model's own, constrained.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest

from session_runtime.constrained import wire
from session_runtime.constrained.spec import NONE

from tests.api.conftest import create, served, step_ok

MODEL = "tiny"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
              {"type": "function", "function": {"name": "get_time", "parameters": {
                  "type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 23}},
                  "required": ["zone"], "additionalProperties": False}}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
CAP = 160  # at effort low: reasoning 40 tokens, then the call or the answer
LOW = {"reasoning_effort": "low"}


@pytest.fixture(scope="module")
def server():
    """A server of its own: a tool-call prompt and its call outgrow the shared one's 512-token context."""
    with served(max_context=2048) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture
def rt(server):
    yield server.runtime
    server.runtime.check_integrity()


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as c:
        yield c


def chat_messages(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"[constrained {tag}] You call tools."},
            {"role": "user", "content": "Weather in Paris?"}]


def test_chat_forced_call_then_a_schema_answer_on_one_chain(oai, rt):
    messages = chat_messages("chat")
    first = oai.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=CAP, **LOW,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
    messages += [{"role": "assistant", "content": choice.message.content or "", "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "15 C"}]
    second = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=CAP, **LOW, tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}})
    assert second.choices[0].finish_reason == "stop", second
    jsonschema.validate(json.loads(second.choices[0].message.content), ANSWER)
    # The stateless second request continued the first's conversation: its whole prompt and call were cached.
    extra = second.model_extra
    assert extra["conversation_id"] == first.model_extra["conversation_id"]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_chat_none_keeps_the_tools_in_the_prompt_and_answers(oai, rt):
    """tool_choice none with tools: the prompt is the one with tools (the next
    request's prefix is cached), the answer never starts a call."""
    messages = chat_messages("none")
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=60,
                                    tool_choice="none", reasoning_effort="minimal")
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.reasoning_content == ""  # minimal: the reasoning block closed at once
    assert r.choices[0].message.content
    auto = oai.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=1)
    assert auto.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_required_picks_one_of_the_tools(oai, rt):
    r = oai.chat.completions.create(model=MODEL, messages=chat_messages("required"), tools=CHAT_TOOLS,
                                    max_tokens=CAP, tool_choice="required", parallel_tool_calls=False, **LOW)
    (call,) = r.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in CHAT_TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_chat_stop_sequences_end_the_output_and_are_never_sent(oai, rt):
    messages = [{"role": "system", "content": "[constrained stop] Be brief."}, {"role": "user", "content": "Go"}]
    free = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=30).choices[0].message
    text = free.reasoning_content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, stop=[stop, "never-seen"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.reasoning_content == text[: text.index(stop)].rstrip("\n")
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, stop=stop, stream=True))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert streamed == cut.choices[0].message.reasoning_content and stop not in streamed


def test_messages_forced_tool_stop_sequence_and_output_format(sdk, rt):
    tools = [{"name": "get_weather", "input_schema": PARAMETERS}]
    body = dict(model=MODEL, max_tokens=CAP, system="[constrained messages] Tools.",
                messages=[{"role": "user", "content": "Weather?"}], thinking={"type": "enabled", "budget_tokens": 40})
    called = sdk.messages.create(**body, tools=tools, tool_choice={"type": "tool", "name": "get_weather"})
    assert called.stop_reason == "tool_use"
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, PARAMETERS)
    answered = sdk.messages.create(**body, extra_body={"output_format": {"type": "json_schema", "schema": ANSWER}})
    (text,) = [b for b in answered.content if b.type == "text"]
    jsonschema.validate(json.loads(text.text), ANSWER)
    free = sdk.messages.create(**{**body, "max_tokens": 20, "system": "[constrained messages stop]"})
    thinking = free.content[0].thinking
    stop = thinking[5:8]
    for stream in (False, True):
        if stream:
            with sdk.messages.stream(**{**body, "max_tokens": 20, "system": "[constrained messages stop]"},
                                     stop_sequences=[stop]) as s:
                reply = s.get_final_message()
        else:
            reply = sdk.messages.create(**{**body, "max_tokens": 20, "system": "[constrained messages stop]"},
                                        stop_sequences=[stop])
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop), reply
        shown = reply.content[0].thinking if reply.content else ""
        assert stop not in shown and thinking.startswith(shown)


def test_responses_forced_function_and_text_format(oai, rt):
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": True}]
    r = oai.responses.create(model=MODEL, input="Weather?", instructions="[constrained responses] Tools.",
                             tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=CAP, reasoning={"effort": "low"})
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    r = oai.responses.create(model=MODEL, input="Answer.", instructions="[constrained responses text]",
                             max_output_tokens=CAP, reasoning={"effort": "low"},
                             text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_the_session_api_takes_chat_s_fields(client, rt):
    cid = create(client, system="[constrained session]", tools=CHAT_TOOLS)
    step = step_ok(client.post(f"/v1/conversations/{cid}/messages", json={
        "content": "Weather?", "max_tokens": CAP, "tool_choice": "required", **LOW}))
    assert step["finish_reason"] == "tool_calls" and len(step["tool_calls"]) == 1
    call = step["tool_calls"][0]
    step = step_ok(client.post(f"/v1/conversations/{cid}/tool_results", json={
        "results": [{"tool_call_id": call["id"], "content": "15 C"}], "max_tokens": CAP, **LOW, "tool_choice": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}}))
    jsonschema.validate(json.loads(step["content"]), ANSWER)


def test_json_mode_is_an_object_schema():
    """JSON mode's grammar: any JSON object (random weights may never close one, so not sampled here)."""
    assert json.loads(wire.chat(None, {"type": "json_object"}, None).answer_schema) == {"type": "object"}
    assert json.loads(wire.responses(None, {"type": "json_object"}).answer_schema) == {"type": "object"}
    assert wire.chat("auto", {"type": "text"}, None) is NONE


@pytest.mark.parametrize("route, body, param, message", [
    ("chat", {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "tool_choice: there is no tool named 'nope' (the tools are 'get_weather', 'get_time')"),
    ("chat", {"tool_choice": "required"}, "tool_choice",
     "tool_choice: a tool call is required, but there are no tools to call"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop: at most 4 stop sequences, got 5"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "loose", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
     "response_format", "Invalid schema for response_format 'loose': In context=(), 'additionalProperties' is "
                        "required to be supplied and to be false"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format", None),
    ("responses", {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", None),
    ("responses", {"text": {"format": {"type": "yaml"}}}, "text.format",
     "text.format: type must be one of text, json_object, json_schema"),
])
def test_bad_constraints_are_400_naming_the_field_and_store_nothing(client, rt, route, body, param, message):
    before = set(rt.conversations)
    base = ({"model": MODEL, "messages": chat_messages("bad"), "max_tokens": 4} if route == "chat"
            else {"model": MODEL, "input": "Hi", "max_output_tokens": 4})
    r = client.post("/v1/chat/completions" if route == "chat" else "/v1/responses", json={**base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and (message is None or error["message"] == message), error
    assert set(rt.conversations) == before


def test_bad_messages_constraints_are_anthropic_400s(sdk, rt):
    before = set(rt.conversations)
    body = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    for extra, message in (
            ({"stop_sequences": [""]}, "stop_sequences: a stop sequence is empty"),
            ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
              "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice: there is no tool named 'g' (the tools "
                                                            "are 'f')"),
            ({"output_format": {"type": "json"}}, 'output_format: expected {"type": "json_schema", "schema": {...}}')):
        with pytest.raises(anthropic.BadRequestError) as bad:
            sdk.messages.create(**body, extra_body=extra)
        assert bad.value.body["error"]["message"] == message
    assert set(rt.conversations) == before


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_openai_agents_sdk_tool_loop_runs(server, api):
    """A real framework's loop: the OpenAI Agents SDK with tool_choice
    required and a structured final output. Each run calls the tool (its
    result reaches the model), then answers in the output type's schema; the
    second run continues the first's history (over Chat, one conversation of
    the server's session inference). After its tool the agent asks
    for an answer (tool_choice none, set by a hook, in place of the SDK's
    reset to auto): under auto the random weights call the tool again rather
    than answer, as they may."""
    import asyncio

    import pydantic
    import dataclasses

    from agents import (Agent, AgentHooks, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    class Report(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        ok: bool
        n: Literal[1, 2, 3]  # bounded: random weights write an unbounded integer's digits to the cap

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # bounded, as Report's n
        """Current weather of a city."""
        seen.append(city)
        return "15 C"

    async def main() -> list:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
            model=MODEL, openai_client=client)
        class AnswerAfterTheTool(AgentHooks):
            async def on_tool_end(self, context, agent, tool, result) -> None:
                agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

        def agent() -> Agent:
            return Agent(name="weather", instructions=f"[constrained agents {api}] Use the tool.", model=model,
                         tools=[get_weather], output_type=Report, hooks=AnswerAfterTheTool(), reset_tool_choice=False,
                         model_settings=ModelSettings(tool_choice="required", max_tokens=CAP,
                                                      reasoning=Reasoning(effort="low")))

        first = await Runner.run(agent(), "Weather in Paris?", max_turns=4)
        second = await Runner.run(agent(), first.to_input_list() + [{"role": "user", "content": "And Rome?"}],
                                  max_turns=4)
        await client.close()
        return [first, second]

    first, second = asyncio.run(main())
    assert len(seen) == 2  # each run called the tool once, then answered
    for result in (first, second):
        assert isinstance(result.final_output, Report)
        outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
        assert outputs == ["15 C"]
    rt = server.runtime
    cids = [c for c in rt.conversations if rt.get(c).system == f"[constrained agents {api}] Use the tool."]
    # Chat: one inferred conversation; Responses: each stored response is one (resp_...), the last holds all.
    assert len(cids) == 1 if api == "chat" else len(cids) == 4
    last = max(cids, key=lambda c: len(rt.describe(c)["trace"]))
    tool_results = [m for m in rt.describe(last)["trace"] if m.get("role") == "tool"]
    assert [m["content"] for m in tool_results] == ["15 C", "15 C"]
