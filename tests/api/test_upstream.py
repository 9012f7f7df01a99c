"""Upstream proxy mode over real loopback HTTP.

A validating upstream (`--validate deepseek`: our server checking requests as
DeepSeek's API does, then answering with the tiny engine) stands in for the
provider; proxies (`--upstream URL`) strip on the way out. The seed's wire
shapes V0-V4 and W1-W6 (tests/protocols/shapes.py) go to the validator
directly, through the default stripper and through the escape hatch, each
with the status the live API gave. A scripted provider (canned DeepSeek
answers with tool calls, every request recorded) drives conversation steps.
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import time
from typing import Iterator, Optional

import httpx
import pytest
from fastapi import Request

from session_runtime.api.settings import ApiSettings
from tests.api.conftest import build_runtime, openai_error_of, served, start_server
from tests.protocols.shapes import EXPECTED, SHAPES

# ----- servers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    """Our server in --validate deepseek mode over its own tiny engine (the
    seed's drafts need more context than the shared runtime's 512 tokens)."""
    rt = build_runtime(max_context=4096, pool_tokens=32768)
    live = start_server(rt, ApiSettings(validate="deepseek"))
    yield live
    live.stop()
    rt.close()


@pytest.fixture(scope="module")
def proxy(validator):
    with served(backend="upstream", upstream_url=validator.url + "/v1") as live:
        yield live


@pytest.fixture(scope="module")
def passthrough_proxy(validator):
    with served(backend="upstream", upstream_url=validator.url + "/v1", reasoning_passthrough=True) as live:
        yield live


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=120)


@contextlib.contextmanager
def recorded(live) -> Iterator[list[dict]]:
    """Every body the proxy sends upstream, as sent."""
    client = live.runtime.backend.client
    sent: list[dict] = []
    real = client.post

    def post_and_record(body: dict, encoded: Optional[bytes] = None):
        if encoded is not None:  # the bytes written from each message's own JSON say what the body says
            assert json.loads(encoded) == body
        sent.append(copy.deepcopy(body))
        return real(body, encoded)

    client.post = post_and_record
    try:
        yield sent
    finally:
        client.post = real


# ----- the seed's wire shapes ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wire_shapes_direct_stripped_and_passthrough(shape, validator, proxy, passthrough_proxy):
    """One row of the regression table: the validator as the live API answered
    the raw body, the default stripper, and the escape hatch (sends it as is)."""
    want = EXPECTED[shape]
    got = (post(validator.url, SHAPES[shape]()).status_code, post(proxy.url, SHAPES[shape]()).status_code,
           post(passthrough_proxy.url, SHAPES[shape]()).status_code)
    assert got == (want.raw, want.stripped, want.passthrough)


def test_the_nudge_rewrite_turns_w3s_400_into_200(validator, proxy):
    body = SHAPES["W3"]()
    assert post(validator.url, body).status_code == 400
    with recorded(proxy) as sent:
        r = post(proxy.url, body)
    assert r.status_code == 200, r.text
    assert sent[0]["messages"][-1] == {"role": "user", "content": body["messages"][-1]["content"]}
    account = json.loads(r.headers["x-session-runtime-stripper"])
    assert account["nudge_rewritten"] and account["mode"] == "lenient"
    assert r.json()["accounting"]["upstream"]["stripper"] == account


@pytest.mark.parametrize("shape,content", [("V0", None), ("V2", "")])
def test_content_null_and_empty_go_out_exactly_as_received(shape, content, proxy):
    body = SHAPES[shape]()
    before = copy.deepcopy(body)
    with recorded(proxy) as sent:
        assert post(proxy.url, body).status_code == 200
    assert body == before  # the client's transcript is never edited
    out = sent[0]["messages"]
    for i in (2, 4):  # the two tool-call turns
        assert "content" in out[i] and out[i]["content"] is None if content is None else out[i]["content"] == ""
        assert "reasoning_content" not in out[i]  # completed turns are stripped in lenient shapes
        assert out[i]["tool_calls"] == before["messages"][i]["tool_calls"]
    assert [m for k, m in enumerate(out) if k not in (2, 4)] == [m for k, m in enumerate(before["messages"])
                                                               if k not in (2, 4)]


def test_stripped_reasoning_is_counted_in_tokens_and_bytes(proxy):
    body = SHAPES["V0"]()
    r = post(proxy.url, body)
    account = r.json()["accounting"]["upstream"]["stripper"]
    texts = [body["messages"][i]["reasoning_content"] for i in (2, 4)]
    tokenizer = proxy.runtime.tokenizer
    assert account["messages_stripped"] == 2
    assert account["stripped_bytes"] == sum(len(t.encode()) for t in texts)
    assert account["stripped_tokens"] == sum(len(tokenizer.encode(t)) for t in texts)
    assert account["sent_reasoning_tokens"] == 0
    assert 0 < account["reasoning_share"] < 1


def test_an_upstream_refusal_comes_back_named_in_our_error_shape(proxy):
    r = post(proxy.url, SHAPES["W5"]())  # strict: a stripped tool-call turn last, sent as is
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "upstream_error", None)
    assert "thinking mode must be passed back" in err["message"]
    upstream = err["upstream"]  # our extension of OpenAI's error object
    assert upstream["known_error"] == "deepseek.reasoning_content_missing"
    assert upstream["status"] == 400 and upstream["stripper"]["mode"] == "strict"
    assert upstream["body"]["error"]["message"].startswith("The `reasoning_content`")


def test_a_streamed_completion_is_relayed(proxy):
    body = {**SHAPES["V1"](), "stream": True, "max_tokens": 2}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert json.loads(r.headers["x-session-runtime-stripper"])["messages_stripped"] == 1
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_an_upstream_that_is_down_is_a_retryable_502():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    with served(backend="upstream", upstream_url=f"http://127.0.0.1:{port}/v1") as live:
        r = post(live.url, SHAPES["V0"]())
        openai_error_of(r, 502, "server_error", code="upstream_unavailable")
        cid = httpx.post(live.url + "/v1/conversations", json={}).json()["id"]
        r = httpx.post(f"{live.url}/v1/conversations/{cid}/messages", json={"content": "hi"}, timeout=60)
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable"
        conv = httpx.get(f"{live.url}/v1/conversations/{cid}").json()
        assert conv["turns"] == [] and conv["trace"] == []  # nothing changed


# ----- conversation steps against a scripted provider --------------------------------------------------


class ScriptedDeepSeek:
    """A DeepSeek stand-in: answers from `replies` in order and records each
    request body. For the conversation tests, where the tiny engine could not
    be made to call a tool."""

    def __init__(self) -> None:
        from fastapi import FastAPI

        self.replies: list[dict] = []
        self.requests: list[dict] = []
        self.app = FastAPI()

        @self.app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict:
            self.requests.append(json.loads(await request.body()))
            message = self.replies.pop(0)
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            return {"id": f"r{len(self.requests)}", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110,
                              "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36}}


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """A stand-in provider's ASGI app on loopback; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def scripted():
    provider = ScriptedDeepSeek()
    with serving(provider.app) as url:
        provider.url = url + "/v1"
        yield provider


CALL = {"id": "call_up_7", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"2+2\"}"}}


def test_a_conversation_keeps_the_providers_message_and_strips_only_on_the_way_out(scripted):
    first = {"role": "assistant", "content": None, "reasoning_content": "I need calc.", "tool_calls": [CALL]}
    answer = {"role": "assistant", "content": "4.", "reasoning_content": "The tool said 4."}
    scripted.replies[:] = [first, answer, {"role": "assistant", "content": "Bye.", "reasoning_content": "End."}]
    scripted.requests.clear()
    with served(backend="upstream", upstream_url=scripted.url, upstream_model="deepseek-v4-flash",
                upstream_params=(("thinking", '{"type": "enabled"}'),)) as live:
        c = httpx.Client(base_url=live.url, timeout=60)
        cid = c.post("/v1/conversations", json={"system": "Use calc."}).json()["id"]
        step = c.post(f"/v1/conversations/{cid}/messages", json={"content": "2+2?"}).json()
        assert "tool_calls" in step, step
        assert step["tool_calls"] == [{"id": "call_up_7", "name": "calc", "arguments": {"expr": "2+2"}}]
        assert step["reasoning"] == "I need calc." and step["accounting"]["cached_input_tokens"] == 64
        assert step["accounting"]["upstream"]["usage"]["cached_input_tokens"] == 64
        step = c.post(f"/v1/conversations/{cid}/tool_results",
                      json={"results": [{"tool_call_id": "call_up_7", "content": "4"}]}).json()
        assert step["content"] == "4." and step["finish_reason"] == "stop"
        # Inside the tool chain the provider's message goes back verbatim, reasoning and content: null included.
        sent = scripted.requests[1]
        assert sent["model"] == "deepseek-v4-flash" and sent["thinking"] == {"type": "enabled"}
        assert sent["messages"][2] == first
        assert sent["messages"][3] == {"role": "tool", "tool_call_id": "call_up_7", "content": "4"}
        step = c.post(f"/v1/conversations/{cid}/messages", json={"content": "Thanks."}).json()
        # The next turn: the closed turn's reasoning is stripped on the way out only.
        sent = scripted.requests[2]["messages"]
        assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "assistant", "user"]
        assert all("reasoning_content" not in m for m in sent)
        assert sent[2] == {k: v for k, v in first.items() if k != "reasoning_content"}
        stripper = step["accounting"]["upstream"]["stripper"]
        assert stripper["messages_stripped"] == 2 and stripper["stripped_bytes"] == len("I need calc.The tool said 4.")
        trace = c.get(f"/v1/conversations/{cid}").json()["trace"]
        assert [m["reasoning"] for m in trace if m["role"] == "assistant"] == ["I need calc.", "The tool said 4.", "End."]
        c.close()


def test_a_chat_completion_with_conversation_id_sends_the_clients_messages_as_written(scripted):
    """A stateful chat client: its assistant messages go upstream as it wrote
    them (content null, the open chain's reasoning), and the answer continues
    the conversation."""
    scripted.replies[:] = [{"role": "assistant", "content": "4.", "reasoning_content": "Done."}]
    scripted.requests.clear()
    mine = {"role": "assistant", "content": None, "reasoning_content": "Call calc.", "tool_calls": [CALL],
            "refusal": None}
    messages = [{"role": "user", "content": "2+2?"}, mine, {"role": "tool", "tool_call_id": "call_up_7", "content": "4"}]
    with served(backend="upstream", upstream_url=scripted.url, upstream_model="m") as live:
        r = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "conversation_id": "chat-1", "create": True, "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "4."
        assert scripted.requests[0]["messages"][1] == mine
        assert [m.role for m in (e.message for e in live.runtime.get("chat-1").trace)] == \
            ["user", "assistant", "tool", "assistant"]


def test_an_upstream_param_of_null_leaves_the_field_out(scripted):
    scripted.replies[:] = [{"role": "assistant", "content": "Hi.", "reasoning_content": "."}]
    scripted.requests.clear()
    with served(backend="upstream", upstream_url=scripted.url, upstream_model="m",
                upstream_params=(("temperature", "null"), ("reasoning_effort", '"high"'))) as live:
        cid = httpx.post(live.url + "/v1/conversations", json={}).json()["id"]
        r = httpx.post(f"{live.url}/v1/conversations/{cid}/messages", json={"content": "hi", "seed": 3}, timeout=60)
        assert r.status_code == 200, r.text
    sent = scripted.requests[0]
    assert "temperature" not in sent and sent["reasoning_effort"] == "high" and sent["seed"] == 3


# ----- Anthropic Messages, OpenAI Responses and Gemini: inbound, validated, and as the upstream ----------------


@pytest.fixture(scope="module", params=["anthropic", "openai-responses", "gemini"])
def protocol_validator(request, validator):
    """The validator's engine behind `--validate PROTOCOL` (Anthropic's base URL has no /v1)."""
    live = start_server(validator.runtime, ApiSettings(validate=request.param))
    yield request.param, live
    live.stop()


REFUSED = {
    "anthropic": ("/v1/messages", {
        "model": "claude-sonnet-4-5", "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                        "input": {"location": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": "15 C"}]}]},
        "Expected `thinking` or `redacted_thinking`"),
    "openai-responses": ("/v1/responses", {
        "model": "gpt-5", "store": False, "reasoning": {"effort": "medium"}, "max_output_tokens": 4, "input": [
            {"role": "user", "content": "Temp in Paris?"},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_temp",
             "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "15"}]},
        "without its required 'reasoning' item"),
    "gemini": ("/v1beta/models/gemini-3-pro-preview:generateContent", {
        "contents": [{"role": "user", "parts": [{"text": "Temp in Paris?"}]},
                     {"role": "model", "parts": [{"functionCall": {"name": "get_temp", "args": {"city": "Paris"}}}]},
                     {"role": "user", "parts": [{"functionResponse": {"name": "get_temp", "response": {"t": 15}}}]}],
        "generationConfig": {"maxOutputTokens": 4}},
        "Function call is missing a thought_signature"),
}


def test_inbound_refusals_are_the_providers_own(protocol_validator):
    protocol, live = protocol_validator
    path, body, text = REFUSED[protocol]
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == 400 and text in json.dumps(r.json()), r.text


def test_a_conversation_runs_through_an_anthropic_responses_or_gemini_upstream(protocol_validator):
    protocol, live = protocol_validator
    base = live.url if protocol in ("anthropic", "gemini") else live.url + "/v1"
    with served(backend="upstream", upstream_url=base, upstream_protocol=protocol, upstream_model="m") as proxy:
        c = httpx.Client(base_url=proxy.url, timeout=120)
        cid = c.post("/v1/conversations", json={"system": "Be brief."}).json()["id"]
        for text in ("Hello", "Again"):
            step = c.post(f"/v1/conversations/{cid}/messages", json={"content": text, "max_tokens": 3}).json()
            assert step["accounting"]["upstream"]["protocol"] == protocol, step
        trace = c.get(f"/v1/conversations/{cid}").json()["trace"]
        assert [m["role"] for m in trace] == ["user", "assistant", "user", "assistant"]
        # The provider's own message went back next turn: kept verbatim in the trace layer.
        wire = proxy.runtime.get(cid).trace[1].message.wire
        assert json.loads(wire)["protocol"] == protocol
        c.close()


# ----- Gemini as the upstream ------------------------------------------------------------------------


class ScriptedGemini:
    """A Gemini stand-in: answers from `replies` (model contents) in order,
    records each request (path, key, body), and refuses as Gemini 3 does a
    request whose current-turn calls lack their signature."""

    def __init__(self) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        from session_runtime.protocols import get_protocol

        self.replies: list[dict] = []
        self.requests: list[tuple[str, Optional[str], dict]] = []
        self.app = FastAPI()

        @self.app.post("/v1beta/models/{target:path}")
        async def generate(target: str, request: Request):
            body = json.loads(await request.body())
            self.requests.append((target, request.headers.get("x-goog-api-key"), body))
            refusal = get_protocol("gemini").validate(body)
            if refusal is not None:
                return JSONResponse(refusal.body, status_code=refusal.status)
            content = self.replies.pop(0)
            return {"candidates": [{"content": content, "finishReason": "STOP", "index": 0}],
                    "usageMetadata": {"promptTokenCount": 100, "cachedContentTokenCount": 60,
                                      "candidatesTokenCount": 5, "thoughtsTokenCount": 3, "totalTokenCount": 108},
                    "modelVersion": "gemini-3-pro", "responseId": f"g{len(self.requests)}"}


@pytest.fixture(scope="module")
def scripted_gemini():
    provider = ScriptedGemini()
    with serving(provider.app) as url:
        provider.url = url
        yield provider


def _thought(text: str) -> dict:
    return {"text": text, "thought": True}


def _call(cid: Optional[str], name: str, args: dict, signature: Optional[str] = None) -> dict:
    part = {"functionCall": {**({"id": cid} if cid else {}), "name": name, "args": args}}
    return {**part, "thoughtSignature": signature} if signature else part


def test_a_conversation_through_a_gemini_upstream_keeps_signatures_and_strips_earlier_thoughts(scripted_gemini):
    """Three turns: parallel calls, then a sequential one, then an answer;
    a call without an id; the current turn goes whole, earlier turns lose their
    thought parts, every signature stays on its part, and every request
    passes Gemini 3's rule (the stand-in refuses any that does not)."""
    A = {"role": "model", "parts": [_thought("two cities"), _call("c1", "weather", {"city": "Paris"}, "SA"),
                                    _call("c2", "weather", {"city": "Rome"})]}
    B = {"role": "model", "parts": [_thought("and the time"), _call("c3", "clock", {"zone": 1}, "SB")]}
    C = {"role": "model", "parts": [_thought("done"), {"text": "Mild."}, {"text": "", "thoughtSignature": "SC"}]}
    D = {"role": "model", "parts": [_thought("oslo"), _call(None, "weather", {"city": "Oslo"}, "SD")]}
    E = {"role": "model", "parts": [{"text": "Cold."}]}
    F = {"role": "model", "parts": [{"text": "Bye."}]}
    g = scripted_gemini
    g.replies[:] = [A, B, C, D, E, F]
    g.requests.clear()
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("weather", "clock")]
    with served(backend="upstream", upstream_url=g.url, upstream_protocol="gemini", upstream_model="gemini-3-pro",
                upstream_key="g-key") as live:
        c = httpx.Client(base_url=live.url, timeout=60)
        cid = c.post("/v1/conversations", json={"system": "Use the tools.", "tools": tools}).json()["id"]

        def ok(r):
            assert r.status_code == 200, r.text
            return r.json()

        step = ok(c.post(f"/v1/conversations/{cid}/messages", json={"content": "Paris and Rome?"}))
        assert [t["id"] for t in step["tool_calls"]] == ["c1", "c2"] and step["reasoning"] == "two cities"
        step = ok(c.post(f"/v1/conversations/{cid}/tool_results", json={"results": [
            {"tool_call_id": "c1", "content": "{\"t\": 20}"}, {"tool_call_id": "c2", "content": "25 C"}]}))
        step = ok(c.post(f"/v1/conversations/{cid}/tool_results",
                         json={"results": [{"tool_call_id": "c3", "content": "13:00"}]}))
        assert step["content"] == "Mild." and step["accounting"]["cached_input_tokens"] == 60
        step = ok(c.post(f"/v1/conversations/{cid}/messages", json={"content": "And Oslo?"}))
        (oslo,) = step["tool_calls"]
        assert oslo["name"] == "weather" and oslo["id"]  # Gemini gave none: the runtime's own
        ok(c.post(f"/v1/conversations/{cid}/tool_results", json={"results": [{"tool_call_id": oslo["id"],
                                                                               "content": "-2 C"}]}))
        step = ok(c.post(f"/v1/conversations/{cid}/messages", json={"content": "Thanks."}))
        assert step["accounting"]["upstream"]["protocol"] == "gemini"
        stripper = step["accounting"]["upstream"]["stripper"]
        c.close()
    paths = {target for target, _, _ in g.requests}
    assert paths == {"gemini-3-pro:generateContent"} and {key for _, key, _ in g.requests} == {"g-key"}
    bodies = [body for _, _, body in g.requests]
    assert all("model" not in b for b in bodies) and bodies[0]["systemInstruction"] == {
        "parts": [{"text": "Use the tools."}]}
    # Inside turn 1 the model's turns go back whole; the results name their calls.
    assert bodies[1]["contents"][1] == A
    assert bodies[1]["contents"][2] == {"role": "user", "parts": [
        {"functionResponse": {"id": "c1", "name": "weather", "response": {"t": 20}}},
        {"functionResponse": {"id": "c2", "name": "weather", "response": {"result": "25 C"}}}]}
    assert bodies[2]["contents"][1:4:2] == [A, B]
    # Turn 2: turn 1's thought parts are gone, each signature still on its part.
    history = bodies[3]["contents"]
    assert history[1] == {"role": "model", "parts": A["parts"][1:]} and history[3] == {"role": "model",
                                                                                     "parts": B["parts"][1:]}
    assert history[5] == {"role": "model", "parts": C["parts"][1:]}
    assert not any(p.get("thought") for m in history for p in m["parts"])
    # The call without an id: its response names it only.
    assert bodies[4]["contents"][-2] == D and bodies[4]["contents"][-1] == {"role": "user", "parts": [
        {"functionResponse": {"name": "weather", "response": {"result": "-2 C"}}}]}
    # Turn 3: turn 2's thoughts stripped too, counted by the stripper.
    assert bodies[5]["contents"][-4] == {"role": "model", "parts": D["parts"][1:]}
    assert stripper["mode"] == "lenient" and stripper["messages_stripped"] == 4
