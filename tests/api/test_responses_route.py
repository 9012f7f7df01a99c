"""`/v1/responses` as an OpenAI Responses endpoint, through the official SDK
over the shared live server: ids on the response and every item, streaming
with Responses' events (each one the SDK's type), stored responses as the
runtime's conversations (previous_response_id, GET, DELETE, a restart),
encrypted reasoning handed out and taken back, and a function-call round trip.

The tiny random model never closes its think block, so its answers are
reasoning cut at max_output_tokens (status incomplete); text and tool calls
are forced server-side by wrapping `Runtime.chat_step` (not an OpenAI
feature), as tests/api/test_openai.py does.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from session_runtime.api.app import create_app
from session_runtime.api.settings import ApiSettings, load_credentials
from session_runtime.errors import BackendUnavailable, ConversationNotFound

from tests.api.conftest import PAGE, first_prompt_len, served

MODEL = "tiny"
EVENTS = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ID = {prefix: re.compile(prefix + r"[0-9a-f]{48}$") for prefix in ("resp_", "rs_", "msg_", "fc_", "call_")}


@pytest.fixture
def oai(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def forcing(monkeypatch, rt, forced: dict) -> None:
    """Every step of the shared runtime answers `forced` until the test ends."""
    real = rt.chat_step

    def chat_step(cid, request, **kw):
        return real(cid, request, **{**kw, "forced": forced})

    monkeypatch.setattr(rt, "chat_step", chat_step)


def sse(client: httpx.Client, body: dict) -> list[dict]:
    """The raw events of a streamed answer; each has `event: TYPE` matching its `type`."""
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == name[len("event: "):]
        out.append(event)
    return out


def check_events(events: list[dict]) -> None:
    """Each event validates as the SDK's type; sequence numbers count from 0."""
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_plain_response_has_ids_on_everything(oai, rt):
    system = "[resp-plain] Ids on everything."
    r = oai.responses.create(model=MODEL, input="Hello", instructions=system, max_output_tokens=4, store=False)
    body = Response.model_validate(r.model_dump())
    assert ID["resp_"].match(body.id) and body.object == "response" and body.model == MODEL
    # Reasoning cut by max_output_tokens: OpenAI's incomplete, with the reason.
    assert (body.status, body.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    [item] = body.output
    assert item.type == "reasoning" and ID["rs_"].match(item.id) and item.content[0].text and item.summary == []
    assert item.encrypted_content is None  # not asked for
    n = first_prompt_len(rt, system, "Hello")
    u = body.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens,
            u.output_tokens_details.reasoning_tokens, u.total_tokens) == (n, 0, 4, 4, n + 4)
    assert (body.instructions, body.max_output_tokens, body.store, body.tool_choice) == (system, 4, False, "auto")
    # store: false keeps nothing to GET.
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(body.id)


def test_streamed_events_say_what_the_plain_answer_says(oai, client, rt):
    system = "[resp-stream] The same greedy answer, streamed."
    request = dict(model=MODEL, input="Hello", instructions=system, max_output_tokens=6, store=False)
    plain = oai.responses.create(**request)
    with oai.responses.stream(**request) as s:
        parsed = list(s)
    events = sse(client, request)
    check_events(events)
    assert [e.type for e in parsed] == [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * 6, "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
    assert deltas == plain.output[0].content[0].text
    last = parsed[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.output[0].content[0].text == deltas and last.output[0].id == parsed[2].item.id
    n = plain.usage.input_tokens
    # The stream's prompt is the plain answer's, whose KV stayed in the tree (evictable): reused in whole pages.
    assert last.usage.model_dump() == {**plain.usage.model_dump(), "input_tokens_details": {
        "cached_tokens": (n - 1) // PAGE * PAGE}}
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    assert len({e.response.id for e in parsed if hasattr(e, "response")}) == 1


def test_a_streamed_answer_with_text_completes(oai, client, rt, monkeypatch):
    """Reasoning item, then the message item; get_final_response is the
    completed response, and the stored one (store defaults to true) is it."""
    forced = {"reasoning": "First I think about it.", "content": "Then I answer, in several tokens."}
    forcing(monkeypatch, rt, forced)
    system = "[resp-stream-text] Forced."
    with oai.responses.stream(model=MODEL, input="Go", instructions=system, max_output_tokens=64) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    reasoning_end, message_start = kinds.index("response.output_item.done"), kinds.index("response.output_text.delta")
    assert reasoning_end < message_start
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == forced["reasoning"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == forced["content"]
    assert final.status == "completed" and final.output_text == forced["content"]
    reasoning, message = final.output
    assert ID["rs_"].match(reasoning.id) and ID["msg_"].match(message.id) and message.status == "completed"
    forced_len = len(rt.template("deepseek").forced_ids(forced["reasoning"], forced["content"]))
    assert final.usage.output_tokens == forced_len
    # The reasoning and its end marker.
    assert final.usage.output_tokens_details.reasoning_tokens == len(rt.tokenizer.encode_text(forced["reasoning"])) + 1
    stored = client.get(f"/v1/responses/{final.id}").json()
    kept = Response.model_validate(stored)
    assert (kept.id, kept.status, kept.output_text, kept.usage) == (final.id, "completed", final.output_text,
                                                                    final.usage)
    assert [(i.id, i.type) for i in kept.output] == [(i.id, i.type) for i in final.output]
    assert client.delete(f"/v1/responses/{final.id}").status_code == 200


def test_a_chain_of_three_turns_reuses_the_previous_context(oai, client, rt):
    """Each follow-up sends only its new input and prefills only that: its
    cached tokens are the whole previous prompt but one. The shared runtime's
    policy is "drop": an earlier turn's reasoning is not in the next prompt,
    so the previous step's chain and the next prompt part at the previous
    turn's `<think>` token, its last prompt token (the fork the turn records);
    everything before it is reused, token for token (the conversation's own
    chain is not cut at pages). The 2 tokens after it (the dropped turn,
    rendered as its answer: the end-of-thinking marker and end of turn) are
    recomputed, then the new user turn is prefilled."""
    system = "[resp-chain] " + "You answer briefly and well. " * 6
    enc = rt.tokenizer.encode
    turns = ["First question here?", "Second question now?", "Third one?"]
    answers = []
    previous = None
    for text in turns:
        extra = {"previous_response_id": previous} if previous else {}
        answers.append(oai.responses.create(model=MODEL, input=text, instructions=system, max_output_tokens=8, **extra))
        previous = answers[-1].id
    cid = answers[0].id  # the first response names the conversation
    conv = rt.get(cid)
    assert len(conv.turns) == 3 and [t.message.role for t in conv.trace] == ["user", "assistant"] * 3
    first = first_prompt_len(rt, system, turns[0])
    usage = [(a.usage.input_tokens, a.usage.input_tokens_details.cached_tokens) for a in answers]
    second = first - 1 + 2 + 1 + len(enc(turns[1])) + 1 + 1  # fork, recomputed turn, <User> text <Assistant> <think>
    third = second - 1 + 2 + 1 + len(enc(turns[2])) + 1 + 1
    assert usage == [(first, 0), (second, first - 1), (third, second - 1)]
    assert [t.fork_tokens for t in conv.turns[:2]] == [first - 1, second - 1]
    for a in answers[1:]:
        assert a.previous_response_id is not None
    # Each response is retrievable; deleting the last one of the conversation deletes it.
    for a in answers:
        assert client.get(f"/v1/responses/{a.id}").json()["id"] == a.id
    for a in answers[:2]:
        assert oai.responses.delete(a.id) is None
    rt.get(cid)
    client.delete(f"/v1/responses/{answers[2].id}").raise_for_status()
    with pytest.raises(ConversationNotFound):
        rt.get(cid)


def test_get_and_delete(client, rt):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                           "instructions": "[resp-get] Kept."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["store"] is True and rt.get(body["id"]).system == "[resp-get] Kept."
    assert client.get(f"/v1/responses/{body['id']}").json() == body
    d = client.delete(f"/v1/responses/{body['id']}")
    assert d.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
    for r in (client.get(f"/v1/responses/{body['id']}"), client.delete(f"/v1/responses/{body['id']}")):
        assert r.status_code == 404 and r.json() == {"error": {
            "message": f"Response with id {body['id']!r} not found.", "type": "invalid_request_error",
            "param": None, "code": "not_found"}}
    with pytest.raises(ConversationNotFound):
        rt.get(body["id"])


def test_previous_response_errors(client, rt):
    def post(**body):
        return client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": "More", **body})

    r = post(previous_response_id="resp_unknown")
    assert (r.status_code, r.json()) == (404, {"error": {
        "message": "Previous response with id 'resp_unknown' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}})
    # Streamed: the error comes before any event, as an HTTP error.
    r = client.post("/v1/responses", json={"input": "More", "stream": True, "previous_response_id": "resp_unknown"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    system = "[resp-errors] Continue only from the end."
    first = post(instructions=system).json()
    second = post(instructions=system, previous_response_id=first["id"]).json()
    r = post(previous_response_id=first["id"])  # a fork from an older response
    assert r.status_code == 409 and r.json()["error"]["code"] == "previous_response_not_latest"
    assert second["id"] in r.json()["error"]["message"]
    r = post(instructions="Other instructions.", previous_response_id=second["id"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "instructions"
    r = post(store=False, previous_response_id=second["id"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
    r = post(input=[{"role": "user", "content": "Old"}, {"role": "assistant", "content": "Old answer"},
                    {"role": "user", "content": "New"}], previous_response_id=second["id"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert len(rt.get(first["id"]).turns) == 2  # none of that changed the conversation
    # Without instructions a follow-up keeps the conversation's system prompt.
    third = post(previous_response_id=second["id"])
    assert third.status_code == 200 and rt.get(first["id"]).system == system
    client.delete(f"/v1/responses/{first['id']}")
    client.delete(f"/v1/responses/{second['id']}")
    # Deleted: its conversation is gone, and it cannot be continued.
    client.delete(f"/v1/responses/{third.json()['id']}")
    r = post(previous_response_id=third.json()["id"])
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"


def test_another_tenants_response_is_404(live, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "a", "key-b": "b"}))
    settings = ApiSettings(credentials=load_credentials(None, str(keys), None))
    with TestClient(create_app(live.runtime, settings)) as c:
        a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
        r = c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=a)
        rid = r.json()["id"]
        assert live.runtime.get(rid).tenant == "a"  # a stored response is a conversation of its tenant
        assert c.get(f"/v1/responses/{rid}", headers=b).status_code == 404
        assert c.delete(f"/v1/responses/{rid}", headers=b).status_code == 404
        r = c.post("/v1/responses", json={"input": "More", "previous_response_id": rid}, headers=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
        assert c.post("/v1/responses", json={"input": "More", "max_output_tokens": 2, "previous_response_id": rid},
                      headers=a).status_code == 200
        assert c.delete(f"/v1/responses/{rid}", headers=a).status_code == 200
    live.runtime.check_integrity()


def test_encrypted_reasoning_round_trip_and_tamper(oai, client, live, rt, monkeypatch):
    system = "[resp-encrypted] Stateless, with encrypted reasoning."
    first = oai.responses.create(model=MODEL, input="Hello", instructions=system, max_output_tokens=4, store=False,
                                 include=["reasoning.encrypted_content"])
    [item] = first.output
    assert live.app.state.secret.decrypt(item.encrypted_content) == item.content[0].text
    # The client keeps no state: it sends the reasoning item back with only its encrypted text.
    sent = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    seen = []
    real = rt.create_conversation
    monkeypatch.setattr(rt, "create_conversation", lambda *a, **kw: seen.append(kw["history"]) or real(*a, **kw))
    body = {"model": MODEL, "instructions": system, "max_output_tokens": 2, "store": False,
            "input": [{"role": "user", "content": "Hello"}, sent,
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
                      {"role": "user", "content": "Again"}]}
    assert client.post("/v1/responses", json=body).status_code == 200
    assert seen[0][1]["reasoning_content"] == item.content[0].text  # the server read its own reasoning back
    tampered = item.encrypted_content[:-2] + ("AA" if not item.encrypted_content.endswith("AA") else "BB")
    body["input"][1] = {**sent, "encrypted_content": tampered}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_encrypted_content",
                                                        "input[1].encrypted_content")
    assert len(seen) == 1  # refused before anything ran


def test_a_function_call_round_trip(oai, client, rt, monkeypatch):
    """A streamed function call, its output answered through previous_response_id."""
    forcing(monkeypatch, rt, {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    system = "[resp-tools] Call the tool."
    events = sse(client, {"model": MODEL, "input": "Weather in Paris?", "instructions": system, "tools": TOOLS,
                          "max_output_tokens": 64})
    check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    response = events[-1]["response"]
    Response.model_validate(response)
    call = response["output"][-1]
    assert call["type"] == "function_call" and ID["fc_"].match(call["id"]) and ID["call_"].match(call["call_id"])
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert events[-3]["arguments"] == events[-4]["delta"] == call["arguments"]
    monkeypatch.undo()
    answer = oai.responses.create(model=MODEL, previous_response_id=response["id"], tools=TOOLS, max_output_tokens=2,
                                  input=[{"type": "function_call_output", "call_id": call["call_id"],
                                          "output": "15 C"}])
    assert answer.previous_response_id == response["id"]
    trace = rt.get(response["id"]).trace
    assert [(e.message.role, e.message.content) for e in trace[2:3]] == [("tool", "15 C")]
    # The runtime keeps its own call id; the response's random call_id was mapped back to it.
    assert trace[2].message.tool_call_id == trace[1].message.tool_calls[0].id != call["call_id"]
    # A call_id the previous response did not make is refused by the runtime (409), and changes nothing.
    r = client.post("/v1/responses", json={"previous_response_id": answer.id, "input": [
        {"type": "function_call_output", "call_id": "call_other", "output": "x"}]})
    assert r.status_code == 409 and len(rt.get(response["id"]).trace) == 4
    client.delete(f"/v1/responses/{response['id']}")
    client.delete(f"/v1/responses/{answer.id}")


def test_an_error_after_the_stream_started_is_response_failed(client, rt, monkeypatch):
    def chat_step(cid, request, on_token=None, **kw):
        on_token(rt.tokenizer.encode("x")[0])  # the stream starts: one token out
        raise BackendUnavailable("the backend went away")

    monkeypatch.setattr(rt, "chat_step", chat_step)
    events = sse(client, {"model": MODEL, "input": "Hi", "store": False, "max_output_tokens": 4})
    check_events(events)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the backend went away"}


def test_stored_responses_survive_a_restart(tmp_path):
    with served(data_dir=str(tmp_path)) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        first = c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                              "instructions": "[resp-restart]"}).json()
    with served(data_dir=str(tmp_path)) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        assert c.get(f"/v1/responses/{first['id']}").json() == first
        r = c.post("/v1/responses", json={"input": "Again", "max_output_tokens": 2,
                                          "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        assert len(live.runtime.get(first["id"]).turns) == 2
