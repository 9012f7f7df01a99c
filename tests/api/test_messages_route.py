"""`POST /v1/messages` and `/v1/messages/count_tokens` as Anthropic's SDK
speaks to them, over the shared live server of conftest.py: plain and
streamed answers that parse as the SDK's types and agree with each other,
ids of Anthropic's shape, signed thinking blocks checked when sent back, a
tool-use round trip, tool_choice auto and none, usage and count_tokens.

The tiny model's random weights never close the think block: a greedy answer
is all thinking and ends on max_tokens. Tool calls and text are forced
server-side by wrapping Runtime.chat_step (as test_openai.py does), keyed on
each test's own system prompt.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from session_runtime.errors import BackendUnavailable
from session_runtime.server_secret import ServerSecret

from tests.api.conftest import first_prompt_len

MODEL = "tiny"
TOOLS = [{"name": "get_weather", "description": "Weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = {"reasoning": "I should look it up.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
ANSWER = {"reasoning": "The tool said 15 C.", "content": "It is 15 C in Paris."}
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def sdk(live):
    with anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0) as c:
        yield c


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def anthropic_error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def force(monkeypatch, rt, outputs: dict) -> None:
    """Wrap rt.chat_step: a request whose system prompt is a key of `outputs`
    gets that forced output; tool results ("results" in the key's place) too."""
    real = rt.chat_step

    def chat_step(cid, request, **kw):
        key = (request.system, "message" if request.user_content is not None else "results")
        if key in outputs:
            kw["forced"] = outputs[key]
        return real(cid, request, **kw)

    monkeypatch.setattr(rt, "chat_step", chat_step)


def blocks(msg) -> list[dict]:
    """A message's content blocks as dicts (the stream's final message has parsed blocks)."""
    return [b.model_dump(exclude_none=True) for b in msg.content]


def raw_events(client: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, read as SSE."""
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        text = r.read().decode()
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ----- plain and streamed answers ----------------------------------------------------------------


def test_a_plain_answer_is_an_anthropic_message(sdk, live, rt):
    system = "[messages] A plain answer."
    raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=6, system=system, messages=[user("Hi")])
    body = raw.http_response.json()
    msg = Message.model_validate(body)  # validated, not merely constructed
    assert re.fullmatch(r"msg_[0-9a-f]{24}", msg.id) and (msg.type, msg.role, msg.model) == ("message", "assistant", MODEL)
    assert [b.type for b in msg.content] == ["thinking"] and msg.stop_reason == "max_tokens"
    assert msg.stop_sequence is None
    thinking = msg.content[0]
    assert thinking.thinking and thinking.signature == live.app.state.secret.sign(thinking.thinking)
    prompt = first_prompt_len(rt, system, "Hi")
    assert body["usage"] == {"input_tokens": prompt, "cache_read_input_tokens": 0, "output_tokens": 6,
                             "output_tokens_details": {"thinking_tokens": 6}}
    assert sdk.messages.create(model=MODEL, max_tokens=6, system=system, messages=[user("Hi")]).id != msg.id


def test_the_stream_is_anthropics_event_sequence_and_says_what_the_plain_answer_says(sdk, client, live, rt):
    system = "[messages] Streamed and plain, one greedy answer."
    body = {"model": MODEL, "max_tokens": 8, "system": system, "messages": [user("Tell me")]}
    plain = sdk.messages.create(**body)
    events = raw_events(client, body)
    names = [name for name, _ in events]
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * (names.count(
        "content_block_delta")) + ["content_block_stop", "message_delta", "message_stop"]
    for name, data in events:
        assert data["type"] == name
        if name != "ping":  # the SDK skips pings; every other event is one of its types, validated
            EVENTS.validate_python(data)
    start = events[0][1]["message"]
    assert re.fullmatch(r"msg_[0-9a-f]{24}", start["id"]) and start["id"] != plain.id
    # message_start is sent once the prompt is matched and prefilled: the real input figures, the first page cached.
    prompt = first_prompt_len(rt, system, "Tell me")
    assert (start["content"], start["model"], start["usage"]) == ([], MODEL, {
        "input_tokens": prompt - 16, "cache_read_input_tokens": 16, "cache_creation_input_tokens": 0,
        "output_tokens": 0})
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {d["type"] for d in deltas[:-1]} == {"thinking_delta"} and deltas[-1]["type"] == "signature_delta"
    assert "".join(d["thinking"] for d in deltas[:-1]) == plain.content[0].thinking
    assert deltas[-1]["signature"] == plain.content[0].signature
    # Anthropic's cumulative usage at the end.
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                             "usage": {"input_tokens": prompt - 16, "cache_read_input_tokens": 16,
                                       "cache_creation_input_tokens": 0, "output_tokens": 8,
                                       "output_tokens_details": {"thinking_tokens": 8}}}
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens == prompt

    with sdk.messages.stream(**body) as s:
        seen = list(s)
        final = s.get_final_message()
    assert [e.type for e in seen if e.type in ("message_start", "message_stop")] == ["message_start", "message_stop"]
    assert blocks(final) == blocks(plain) and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens,
            final.usage.output_tokens_details.thinking_tokens) == (prompt - 16, 16, 8, 8)
    rt.check_integrity()


def test_text_after_thinking_in_two_blocks(sdk, rt, live, monkeypatch):
    system = "[messages] Thinking, then text."
    force(monkeypatch, rt, {(system, "message"): ANSWER})
    body = dict(model=MODEL, max_tokens=64, system=system, messages=[user("Weather?")])
    plain = sdk.messages.create(**body)
    with sdk.messages.stream(**body) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", ANSWER["reasoning"]), ("text", ANSWER["content"])]
    assert blocks(final) == blocks(plain) and (final.stop_reason, plain.stop_reason) == ("end_turn", "end_turn")
    assert final.content[0].signature == live.app.state.secret.sign(ANSWER["reasoning"])
    assert kinds.count("content_block_stop") == 2 and kinds.count("text") > 1 and kinds.count("thinking") > 1
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_a_late_error_is_an_error_event(client, rt, monkeypatch):
    """After the first token the status is sent: an error is Anthropic's
    `error` event (overloaded for an engine that went away), and no message_stop."""
    tok = rt.tokenizer.encode_text("Hello")[0]

    def chat_step(cid, request, on_token=None, **kw):
        on_token(tok)
        raise BackendUnavailable("the engine went away")

    monkeypatch.setattr(rt, "chat_step", chat_step)
    events = raw_events(client, {"model": MODEL, "max_tokens": 4, "messages": [user("Hi")]})
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "error"]
    assert events[-1][1] == anthropic_error("the engine went away", "overloaded_error")


def test_an_error_before_the_stream_is_a_plain_http_error(sdk):
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(model=MODEL, max_tokens=2, stream=True, messages=[
            user("Hi"), {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "forged"},
                                                          {"type": "text", "text": "Hello"}]}, user("Again")])
    assert bad.value.body["type"] == "error" and "Invalid `signature`" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(model=MODEL, max_tokens=2, messages=[user("Hi")], stream="yes")
    assert bad.value.body == anthropic_error("stream: expected a boolean")


# ----- tool use ---------------------------------------------------------------------------------


def test_a_tool_use_round_trip(sdk, client, rt, monkeypatch):
    """The call comes back as a tool_use block under a toolu_ id; the client
    sends it back with its tool_result, and the next request pairs them."""
    system = "[messages] Tool round trip."
    force(monkeypatch, rt, {(system, "message"): CALL, (system, "results"): ANSWER})
    first = sdk.messages.create(model=MODEL, max_tokens=64, system=system, tools=TOOLS, messages=[user("Paris?")])
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    call = first.content[1]
    assert re.fullmatch(r"toolu_[0-9a-f]{24}_0_0_0", call.id) and (call.name, call.input) == ("get_weather", {"city": "Paris"})
    history = [user("Paris?"), {"role": "assistant", "content": blocks(first)},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "15 C"}]}]
    raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=64, system=system, tools=TOOLS,
                                                messages=history)
    second = raw.parse()
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("thinking", None),
                                                                             ("text", ANSWER["content"])]
    assert second.stop_reason == "end_turn"
    # The stateless requests are one conversation: the tool result continued the turn its user message opened.
    cid = raw.headers["x-session-runtime-conversation"]
    turns = client.get(f"/v1/conversations/{cid}").json()["turns"]
    assert [len(t["steps"]) for t in turns] == [2] and turns[0]["closed"]
    assert client.get(f"/v1/conversations/{cid}").json()["inferred"] == "anthropic"
    counted = sdk.messages.count_tokens(model=MODEL, system=system, tools=TOOLS, messages=history).input_tokens
    assert counted == second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0  # the first request's prompt and call, kept in the tree
    # A result for another id answers no call of the history.
    stray = history[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_other",
                                                         "content": "15 C"}]}]
    with pytest.raises(anthropic.APIStatusError) as bad:
        sdk.messages.create(model=MODEL, max_tokens=4, system=system, tools=TOOLS, messages=stray)
    assert bad.value.status_code == 409 and "toolu_other" in bad.value.body["error"]["message"]

    # Streamed: the call as a tool_use block with its input as JSON deltas.
    with sdk.messages.stream(model=MODEL, max_tokens=64, system=system, tools=TOOLS, messages=[user("Paris?")]) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[1].input == {"city": "Paris"} and final.content[1].id.startswith("toolu_")
    assert final.content[1].id != call.id
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    rt.check_integrity()


def test_tool_choice(sdk, client, rt):
    """auto as the model decides; none leaves the tools out of the prompt
    (any and tool force a call: test_constrained_routes.py)."""
    system = "[messages] tool_choice."
    body = dict(model=MODEL, max_tokens=2, system=system, messages=[user("Hi")])
    r = client.post("/v1/messages", json={**body, "tool_choice": {"type": "sometimes"}})
    assert r.status_code == 400 and r.json() == anthropic_error(
        "tool_choice: expected an object with type one of auto, any, tool, none")
    count = {k: v for k, v in body.items() if k != "max_tokens"}
    with_tools = sdk.messages.count_tokens(**count, tools=TOOLS).input_tokens
    without = sdk.messages.count_tokens(**count).input_tokens
    assert with_tools > without
    assert sdk.messages.count_tokens(**count, tools=TOOLS, tool_choice={"type": "none"}).input_tokens == without
    assert sdk.messages.count_tokens(**count, tools=TOOLS, tool_choice={"type": "auto"}).input_tokens == with_tools
    answer = sdk.messages.create(**body, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == without


# ----- thinking signatures ----------------------------------------------------------------------


def test_thinking_blocks_sent_back_must_be_this_servers(sdk, rt, live):
    system = "[messages] Signatures."
    first = sdk.messages.create(model=MODEL, max_tokens=4, system=system, messages=[user("One")])
    block = first.content[0].model_dump()

    def again(thinking_block: dict):
        return sdk.messages.create(model=MODEL, max_tokens=2, system=system, messages=[
            user("One"), {"role": "assistant", "content": [thinking_block, {"type": "text", "text": "Done."}]},
            user("Two")])

    assert again(block).stop_reason == "max_tokens"  # the round trip is accepted
    foreign = ServerSecret(b"\x01" * 32).sign(block["thinking"])
    for bad_block in ({**block, "signature": block["signature"][:-2] + "xx"},
                      {**block, "thinking": block["thinking"] + "!"},
                      {**block, "signature": foreign},
                      {k: v for k, v in block.items() if k != "signature"}):
        with pytest.raises(anthropic.BadRequestError) as bad:
            again(bad_block)
        want = anthropic_error("messages.1.content.0: Invalid `signature` in `thinking` block")
        assert (bad.value.status_code, bad.value.body) == (400, want)
    with pytest.raises(anthropic.BadRequestError) as bad:
        again({"type": "redacted_thinking", "data": "abc"})
    assert bad.value.body == anthropic_error(
        "messages.1.content.0: `redacted_thinking` blocks are not made by this server, so none can be sent to it")
    # count_tokens checks them too.
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.count_tokens(model=MODEL, system=system, messages=[
            user("One"), {"role": "assistant", "content": [{**block, "signature": foreign}]}, user("Two")])
    rt.check_integrity()


# ----- count_tokens -----------------------------------------------------------------------------


def test_count_tokens_is_the_prompt_of_the_same_request(sdk, client, rt):
    system = "[messages] Counted."
    messages = [user("First"), {"role": "assistant", "content": "An answer."}, user("Second")]
    counted = sdk.messages.count_tokens(model=MODEL, system=system, messages=messages)
    answer = sdk.messages.create(model=MODEL, max_tokens=2, system=system, messages=messages)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert sdk.messages.count_tokens(model=MODEL, messages=[user("Hi")]).input_tokens == first_prompt_len(rt, None, "Hi")
    before = set(rt.conversations)
    r = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
    assert (r.status_code, r.json()) == (400, anthropic_error("messages: at least one message is required"))
    r = client.post("/v1/messages/count_tokens", json={"model": "claude-x", "messages": [user("Hi")]})
    assert (r.status_code, r.json()) == (404, anthropic_error(
        "the model 'claude-x' does not exist: this server serves 'tiny' (GET /v1/models)", "not_found_error"))
    r = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "robot"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].role")
    assert set(rt.conversations) == before  # nothing kept


def test_a_stream_whose_client_disconnects_is_cancelled_and_leaves_nothing(live, rt, monkeypatch):
    """The client reads the first delta of a long decode and leaves: the step
    is cancelled (it would have run 400 tokens) and its throw-away conversation is gone."""
    import threading

    real, outcome, done = rt.chat_step, {}, threading.Event()

    def chat_step(cid, request, **kw):
        try:
            outcome["step"] = real(cid, request, **kw)
        except Exception as exc:
            outcome["error"] = exc
            raise
        finally:
            done.set()
        return outcome["step"]

    monkeypatch.setattr(rt, "chat_step", chat_step)
    before = set(rt.conversations)
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "messages": [user("Go on and on")]}
    with httpx.Client(base_url=live.url, timeout=60) as c:
        with c.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if "content_block_delta" in line)
    assert done.wait(60), "the abandoned step never stopped"
    assert type(outcome.get("error")).__name__ == "StepCancelled", outcome
    assert set(rt.conversations) == before
    rt.check_integrity()


def test_tool_choice_none_with_a_tool_history(sdk, rt, monkeypatch):
    """none leaves the tools out of the prompt; a history of tool_use and
    tool_result blocks still renders (as calls and results) and is answered."""
    system = "[messages] none after a call."
    force(monkeypatch, rt, {(system, "message"): CALL})
    first = sdk.messages.create(model=MODEL, max_tokens=64, system=system, tools=TOOLS, messages=[user("Paris?")])
    call = first.content[1]
    history = [user("Paris?"), {"role": "assistant", "content": blocks(first)},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "15 C"}]}]
    answer = sdk.messages.create(model=MODEL, max_tokens=2, system=system, tools=TOOLS, messages=history,
                                 tool_choice={"type": "none"})
    counted = sdk.messages.count_tokens(model=MODEL, system=system, messages=history).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    assert counted < sdk.messages.count_tokens(model=MODEL, system=system, tools=TOOLS, messages=history).input_tokens
