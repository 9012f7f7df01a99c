"""POST /v1/chat/completions with the official `openai` client over loopback:
reasoning_content, usage with cached tokens, conversation_id reuse (the
exact fork point, its partial page private to the chain), a tool-call history round trip, streaming, a
history that replaces the conversation's, and errors.

The shared server (tests/api/conftest.py): 'tiny' preset, page 16, context 512,
default policy "drop". Greedy decoding of the random-weight model never closes
its think block, so sampled outputs are all reasoning; content deltas are
exercised with output forced server-side (test_stream_content_deltas).
"""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from tests.api.conftest import PAGE, create, error_of, first_prompt_len, step_ok

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def oai(live):
    with OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def chat(oai, messages, **kw):
    return oai.chat.completions.create(model="tiny", messages=messages, **kw)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def sys(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def reply(r) -> dict:
    """The assistant message a client sends back next time."""
    m = r.choices[0].message
    return {"role": "assistant", "content": m.content, "reasoning_content": m.reasoning_content}


def test_chat_with_system_and_user(oai, client, rt):
    system = "[basic] You are a terse assistant."
    r = chat(oai, [sys(system), user("Hello")], max_tokens=8, extra_body={"conversation_id": "oa-basic", "create": True})
    n = first_prompt_len(rt, system, "Hello")
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    assert isinstance(choice.message.reasoning_content, str) and choice.message.reasoning_content
    assert choice.message.tool_calls is None
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n, 8, n + 8)
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.completion_tokens_details.reasoning_tokens == 8  # never left its think block
    assert extra(r, "conversation_id") == "oa-basic"

    d = client.get("/v1/conversations/oa-basic").json()
    assert (d["system"], d["policy"], d["tools"]) == (system, "drop", [])
    assert [(t["role"], t["content"], t.get("reasoning")) for t in d["trace"]] == [
        ("user", "Hello", None), ("assistant", choice.message.content, choice.message.reasoning_content)]
    assert d["turns"][0]["steps"] == [extra(r, "accounting")]

    # A model the server does not serve is 404 model_not_found, as OpenAI answers it; no model is the served one.
    count = len(rt.conversations)
    with pytest.raises(openai.NotFoundError) as e:
        chat(oai, [sys(system), user("Hello")], max_tokens=1, extra_body={"model": "anything"})
    assert e.value.response.json() == {"error": {
        "message": "the model 'anything' does not exist: this server serves 'tiny' (GET /v1/models)",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert len(rt.conversations) == count
    r2 = client.post("/v1/chat/completions", json={"messages": [sys(system), user("Hello")], "max_tokens": 1})
    assert (r2.json()["model"], r2.json()["usage"]["completion_tokens"]) == ("tiny", 1)


def test_conversation_id_reuses_the_exact_fork(oai, client, rt):
    system = "[reuse] You are a meticulous assistant for the conversation reuse test. Answer briefly and politely, always. " * 2
    u1, u2 = "What is the capital of France?", "And of Spain?"
    enc = rt.tokenizer.encode
    assert len(enc(system)) > 2 * PAGE
    fork = 1 + len(enc(system)) + 1 + len(enc(u1)) + 1  # bos system <User> u1 <Assistant>: then <think> vs </think>
    assert fork == 1 + 45 + 1 + 7 + 1 and fork // PAGE * PAGE == 48

    # 11 output tokens: r1's computed sequence (55 + 11 - 1 = 65) fills the tree's
    # pages up to 64, past the fork (inside page 48..63). At the turn's close the
    # drop chain moves to the fork exactly (its partial page copied into a private
    # page), so the conversation's next turn reuses all 55 tokens: no alignment loss.
    r1 = chat(oai, [sys(system), user(u1)], max_tokens=11, extra_body={"conversation_id": "oa-reuse", "create": True})
    assert r1.usage.prompt_tokens == fork + 1 and r1.usage.prompt_tokens_details.cached_tokens == 0
    r2 = chat(oai, [sys(system), user(u1), reply(r1), user(u2)], max_tokens=6,
              extra_body={"conversation_id": "oa-reuse"})
    # The drop policy renders turn 0 without its reasoning: </think> answer eos.
    answer = len(enc(r1.choices[0].message.content or ""))
    assert r2.usage.prompt_tokens == fork + 1 + answer + 1 + 1 + len(enc(u2)) + 1 + 1
    assert r2.usage.prompt_tokens_details.cached_tokens == fork == 55
    acc = extra(r2, "accounting")
    assert (acc["logical_reusable_tokens"], acc["alignment_loss_tokens"]) == (fork, 0)
    assert acc["cache_state"] == "prefix_only"

    d = client.get("/v1/conversations/oa-reuse").json()
    assert len(d["turns"]) == 2 and d["turns"][0]["fork_tokens"] == fork
    assert d["turns"][1]["steps"] == [acc]
    assert [t["content"] for t in d["trace"] if t["role"] == "user"] == [u1, u2]
    assert d["history"][1]["reasoning"] == ""  # dropped from the canonical history
    assert d["trace"][1]["reasoning"] == r1.choices[0].message.reasoning_content


def test_without_conversation_id_the_request_is_an_inferred_conversation(oai, client, rt):
    """A request without conversation_id is a conversation the server infers:
    listed under its id, marked inferred; the same request again is a retry of
    its step (the same answer, no second turn); its continuation is its next turn."""
    system = "[inferred] A stateless client's conversation, inferred from its history. " * 2
    n = first_prompt_len(rt, system, "Hi")
    count = len(rt.conversations)
    r1 = chat(oai, [sys(system), user("Hi")], max_tokens=3)
    cid = extra(r1, "conversation_id")
    assert len(rt.conversations) == count + 1
    d = client.get(f"/v1/conversations/{cid}").json()
    assert d["inferred"] == "openai-chat" and len(d["turns"]) == 1
    assert r1.usage.prompt_tokens == n
    r2 = chat(oai, [sys(system), user("Hi")], max_tokens=3)
    assert extra(r2, "conversation_id") == cid
    assert r2.choices[0].message.reasoning_content == r1.choices[0].message.reasoning_content
    assert len(client.get(f"/v1/conversations/{cid}").json()["turns"]) == 1
    answer = r1.choices[0].message
    r3 = chat(oai, [sys(system), user("Hi"), {"role": "assistant", "content": answer.content}, user("More")],
              max_tokens=3)
    assert extra(r3, "conversation_id") == cid
    assert len(client.get(f"/v1/conversations/{cid}").json()["turns"]) == 2
    assert r3.usage.prompt_tokens_details.cached_tokens >= n // PAGE * PAGE
    client.delete(f"/v1/conversations/{cid}")


def test_tool_call_history_round_trip(oai, client, rt):
    """A client history with an assistant tool call and its result runs as the
    turn's next step, token for token as the session API's tool round trip."""
    system = "[tools] You can look up the weather."
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [sys(system), user("Weather in Paris?"), {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = chat(oai, messages, tools=TOOLS, max_tokens=6, extra_body={"conversation_id": "oa-tools", "create": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    d = client.get("/v1/conversations/oa-tools").json()
    assert d["tools"] == TOOLS and d["pending_tool_calls"] == []
    assert [(t["role"], t["content"]) for t in d["trace"]] == [
        ("user", "Weather in Paris?"), ("assistant", ""), ("tool", "sunny"),
        ("assistant", r.choices[0].message.content)]
    assert d["trace"][1]["tool_calls"] == [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}]
    assert d["trace"][2]["tool_call_id"] == "call_1"
    assert [(t["turn"], t["closed"], len(t["steps"])) for t in d["turns"]] == [(0, True, 1)]

    # The same turn through the session API: same prompt, same greedy output.
    cid = create(client, system=system, tools=TOOLS, tenant="oa-tools-native")
    step_ok(client.post(f"/v1/conversations/{cid}/messages", json={
        "content": "Weather in Paris?", "forced": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}}))
    native = step_ok(client.post(f"/v1/conversations/{cid}/tool_results", json={
        "results": [{"tool_call_id": "call_0_0_0", "content": "sunny"}], "max_tokens": 6}))
    assert native["accounting"]["prompt_tokens"] == r.usage.prompt_tokens
    assert native["reasoning"] == r.choices[0].message.reasoning_content

    # Sending the history back as returned keeps the conversation and reuses its chain.
    r2 = chat(oai, messages + [reply(r), user("Thanks")], tools=TOOLS, max_tokens=2,
              extra_body={"conversation_id": "oa-tools"})
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    d = client.get("/v1/conversations/oa-tools").json()
    assert [(t["turn"], len(t["steps"])) for t in d["turns"]] == [(0, 1), (1, 1)]


def test_tool_calls_pending_via_openai(oai, client, rt):
    """A history that ends in an assistant tool call leaves the turn open; the
    next request answers it with a tool message."""
    system = "[pending] Tools pending."
    call = {"id": "c9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, [sys(system), user("Rome?"), {"role": "assistant", "content": "", "tool_calls": [call]}],
             tools=TOOLS, max_tokens=2, extra_body={"conversation_id": "oa-pending", "create": True})
    assert e.value.response.json()["error"]["message"] == "the last message must be a user message or tool results"
    r = chat(oai, [sys(system), user("Rome?"), {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c9", "content": "rain"}],
             tools=TOOLS, max_tokens=2, extra_body={"conversation_id": "oa-pending", "create": True})
    assert r.usage.completion_tokens == 2
    d = client.get("/v1/conversations/oa-pending").json()
    assert d["trace"][1]["tool_calls"] == [{"id": "c9", "name": "get_weather", "arguments": {"city": "Rome"}}]


def test_a_history_that_differs_is_refused_and_replace_replaces_it(oai, client, rt):
    system = "[replace] A conversation whose history a client rewrites."
    u1, u2 = "First question?", "Second question?"
    enc = rt.tokenizer.encode
    r1 = chat(oai, [sys(system), user(u1)], max_tokens=4, extra_body={"conversation_id": "oa-replace", "create": True})
    fork = 1 + len(enc(system)) + 1 + len(enc(u1)) + 1
    stored = client.get("/v1/conversations/oa-replace", params={"tokens": 1}).json()

    # A rewritten answer is refused with 409, naming the message; nothing changes.
    rewritten = {"role": "assistant", "content": "A different answer."}
    with pytest.raises(openai.ConflictError) as e:
        chat(oai, [sys(system), user(u1), rewritten, user(u2)], max_tokens=4,
             extra_body={"conversation_id": "oa-replace"})
    err = e.value.response.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "history_conflict", "messages")
    assert err["message"].startswith("messages[2] (assistant) differs from the stored assistant message of "
                                     "conversation 'oa-replace'")
    assert client.get("/v1/conversations/oa-replace", params={"tokens": 1}).json() == stored

    # With "replace": true the client's history becomes the conversation's.
    r2 = chat(oai, [sys(system), user(u1), rewritten, user(u2)], max_tokens=4,
              extra_body={"conversation_id": "oa-replace", "replace": True})
    assert r2.usage.prompt_tokens == fork + 1 + len(enc("A different answer.")) + 1 + 1 + len(enc(u2)) + 1 + 1
    # The conversation's own chain sits at turn 0's fork exactly (a private
    # partial page), and the rewritten history still shares that prefix.
    assert r2.usage.prompt_tokens_details.cached_tokens == fork == 18
    d = client.get("/v1/conversations/oa-replace").json()
    assert [(t["role"], t["content"]) for t in d["trace"]] == [
        ("user", u1), ("assistant", "A different answer."), ("user", u2), ("assistant", r2.choices[0].message.content)]
    assert d["trace"][1]["reasoning"] == ""  # r1's reasoning is gone with its message
    assert [(t["turn"], t["closed"], len(t["steps"])) for t in d["turns"]] == [(0, True, 0), (1, True, 1)]
    assert d["turns"][1]["steps"] == [extra(r2, "accounting")]
    assert r1.choices[0].message.reasoning_content not in [t.get("reasoning") for t in d["trace"]]

    # Sent back unchanged (reasoning dropped by the client, as clients may), it is kept.
    r3 = chat(oai, [sys(system), user(u1), rewritten, user(u2), {"role": "assistant", "content": r2.choices[0].message.content},
                    user("Third?")], max_tokens=2, extra_body={"conversation_id": "oa-replace"})
    d3 = client.get("/v1/conversations/oa-replace").json()
    assert d3["turns"][:2] == d["turns"][:2] and len(d3["turns"]) == 3
    assert d3["turns"][2]["steps"] == [extra(r3, "accounting")]

    # Another system prompt under the same id: 409, or another conversation with replace.
    with pytest.raises(openai.ConflictError) as e:
        chat(oai, [sys("[replace] Another system."), user(u1)], max_tokens=1,
             extra_body={"conversation_id": "oa-replace"})
    assert e.value.response.json()["error"]["message"].startswith(
        "messages[0]: the request's system prompt differs from that of conversation 'oa-replace'")
    chat(oai, [sys("[replace] Another system."), user(u1)], max_tokens=1,
         extra_body={"conversation_id": "oa-replace", "replace": True})
    d4 = client.get("/v1/conversations/oa-replace").json()
    assert d4["system"] == "[replace] Another system." and len(d4["turns"]) == 1


def test_stream_with_the_client(oai, rt):
    system = "[stream] Streaming through the openai client."
    n = first_prompt_len(rt, system, "Stream please")
    plain = chat(oai, [sys(system), user("Stream please")], max_tokens=8)
    chunks = list(chat(oai, [sys(system), user("Stream please")], max_tokens=8, stream=True,
                       stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.model == "tiny" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"  # the first delta names the role, as OpenAI's
    body, last = chunks[1:-1], chunks[-1]
    assert all(c.choices[0].finish_reason is None for c in body)
    reasoning = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert reasoning == plain.choices[0].message.reasoning_content and reasoning
    assert content == plain.choices[0].message.content == ""
    assert last.choices[0].finish_reason == "length"
    u = last.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n, 8, n + 8)
    assert u.prompt_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE  # the plain request's KV


def test_stream_content_deltas(oai, client, rt, monkeypatch):
    """reasoning_content deltas, then content deltas, then finish_reason and usage.
    The random model never closes its think block, so the output is forced
    server-side for this request (not an OpenAI feature)."""
    system = "[stream-forced] Forced through a wrapper."
    f = {"reasoning": "First I think about the question.", "content": "Then I answer it, in several tokens."}
    real = rt.chat_step

    def chat_step(cid, request, **kw):
        if cid == "oa-stream-forced":
            kw["forced"] = f
        return real(cid, request, **kw)

    monkeypatch.setattr(rt, "chat_step", chat_step)
    chunks = list(chat(oai, [sys(system), user("Go")], max_tokens=4, stream=True,
                       stream_options={"include_usage": True}, extra_body={"conversation_id": "oa-stream-forced", "create": True}))
    monkeypatch.undo()
    body, last = chunks[1:-1], chunks[-1]
    kinds = ["r" if extra(c.choices[0].delta, "reasoning_content") else "c" for c in body]
    assert kinds.count("r") > 1 and kinds.count("c") > 1 and kinds == sorted(kinds, key=lambda k: k != "r")
    assert "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in body) == f["reasoning"]
    assert "".join(c.choices[0].delta.content or "" for c in body) == f["content"]
    assert last.choices[0].finish_reason == "stop"  # forced maps to stop
    forced_len = len(rt.template("deepseek").forced_ids(f["reasoning"], f["content"]))
    assert last.usage.completion_tokens == forced_len
    # The reasoning and its end marker; then the answer and eos.
    assert last.usage.completion_tokens_details.reasoning_tokens == len(rt.tokenizer.encode_text(f["reasoning"])) + 1
    assert extra(last, "conversation_id") == "oa-stream-forced"
    d = client.get("/v1/conversations/oa-stream-forced").json()
    assert (d["trace"][1]["reasoning"], d["trace"][1]["content"]) == (f["reasoning"], f["content"])


def test_errors(oai, client, rt):
    """OpenAI's shape, status codes and types: 400 invalid_request_error for bad
    input and a malformed body (not 422), context_length_exceeded for a prompt over the context."""
    def status_of(messages, **kw):
        with pytest.raises(openai.APIStatusError) as e:
            chat(oai, messages, max_tokens=2, **kw)
        body = e.value.response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        return e.value.status_code, body["error"]

    count = len(rt.conversations)
    assert status_of([sys("only a system prompt")]) == (400, {
        "type": "invalid_request_error", "message": "messages must hold a user message", "param": None, "code": None})
    assert status_of([user("a"), {"role": "assistant", "content": "b"}])[0] == 400
    assert status_of([{"role": "tool", "content": "x"}, user("a")])[1]["message"] == (
        "messages[0]: a tool result must follow an assistant tool call")
    assert status_of([{"role": "robot", "content": "x"}, user("a")])[1]["message"] == (
        "messages[0].role must be user, assistant or tool (system first)")
    code, err = status_of([user("word " * 600)])
    assert (code, err["type"], err["code"]) == (400, "invalid_request_error", "context_length_exceeded")
    code, err = status_of([])
    assert (code, err["type"], err["param"]) == (400, "invalid_request_error", "messages")
    assert err["message"].startswith("body.messages")
    code, err = status_of([user("a")], extra_body={"max_tokens": -1})
    assert (code, err["type"], err["param"]) == (400, "invalid_request_error", "max_tokens")
    assert len(rt.conversations) == count  # a conversation created for a failed request is gone again
    rt.check_integrity()

    # A streamed request whose step fails: the client raises on the error chunk.
    with pytest.raises(openai.APIError):
        list(chat(oai, [user("word " * 600)], max_tokens=2, stream=True))
    assert len(rt.conversations) == count


def test_a_failed_request_with_a_differing_history_changes_nothing(oai, client):
    system = "[fail-replace] A conversation a failed request must not touch."
    chat(oai, [sys(system), user("Hello")], max_tokens=2, extra_body={"conversation_id": "oa-fail-replace", "create": True})
    before = client.get("/v1/conversations/oa-fail-replace", params={"tokens": 1}).json()
    with pytest.raises(openai.APIStatusError) as e:
        chat(oai, [sys(system), user("Other"), {"role": "assistant", "content": "x"}, user("word " * 600)],
             max_tokens=2, extra_body={"conversation_id": "oa-fail-replace", "replace": True})
    assert (e.value.status_code, e.value.code) == (400, "context_length_exceeded")
    assert client.get("/v1/conversations/oa-fail-replace", params={"tokens": 1}).json() == before


def test_a_failed_request_with_another_system_prompt_changes_nothing(oai, client):
    chat(oai, [sys("[fail-system] Original."), user("Hello")], max_tokens=2,
         extra_body={"conversation_id": "oa-fail-system", "create": True})
    before = client.get("/v1/conversations/oa-fail-system", params={"tokens": 1}).json()
    with pytest.raises(openai.APIStatusError) as e:
        chat(oai, [sys("[fail-system] Another."), user("word " * 600)], max_tokens=2,
             extra_body={"conversation_id": "oa-fail-system", "replace": True})
    assert (e.value.status_code, e.value.code) == (400, "context_length_exceeded")
    assert client.get("/v1/conversations/oa-fail-system", params={"tokens": 1}).json() == before


def test_a_failed_request_with_a_new_conversation_id_creates_nothing(oai, client):
    with pytest.raises(openai.APIStatusError) as e:
        chat(oai, [user("word " * 600)], max_tokens=2, extra_body={"conversation_id": "oa-fail-new", "create": True})
    assert (e.value.status_code, e.value.code) == (400, "context_length_exceeded")
    error_of(client.get("/v1/conversations/oa-fail-new"), 404, "not_found")


def test_max_completion_tokens_zero_is_honoured(oai):
    r = chat(oai, [sys("[zero] Zero tokens."), user("Hi")], max_tokens=3, extra_body={"max_completion_tokens": 0})
    assert r.usage.completion_tokens == 0


def test_content_parts_in_the_last_user_message(oai):
    r = chat(oai, [sys("[parts] Content parts."), {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
             max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_content_parts_in_earlier_messages_are_accepted(oai, client):
    r = chat(oai, [sys("[parts-history] Content parts."), {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}, user("Again")],
             max_tokens=2, extra_body={"conversation_id": "oa-parts", "create": True})
    assert r.usage.completion_tokens == 2
    d = client.get("/v1/conversations/oa-parts").json()
    assert [t["content"] for t in d["trace"]][:3] == ["Hi", "Hello.", "Again"]
    assert json.loads(json.dumps(d["history"]))[1]["content"] == "Hello."


def test_unsupported_options_are_400_not_ignored(oai):
    for extra_args in ({"n": 2}, {"stop": [""]}):
        with pytest.raises(openai.BadRequestError):
            chat(oai, [sys("[unsupported] Options."), user("Hi")], max_tokens=2, **extra_args)


def test_stream_usage_only_when_asked(oai):
    chunks = list(chat(oai, [sys("[no-usage] No usage."), user("Hi")], max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_are_honoured(oai, client, rt):
    """Each output token with its logprob: the same numbers as the session API's
    for the same greedy step (a twin in another tenant: both prefill cold)."""
    system = "[logprobs] Report logprobs."
    r = chat(oai, [sys(system), user("Hi")], max_tokens=4, logprobs=True)
    content = r.choices[0].logprobs.content
    twin = create(client, system=system, tenant="oa-logprobs-twin")
    s = step_ok(client.post(f"/v1/conversations/{twin}/messages", json={"content": "Hi", "max_tokens": 4,
                                                                          "logprobs": True}))
    assert [c.logprob for c in content] == s["logprobs"] and len(content) == 4
    assert all(c.top_logprobs == [] and isinstance(c.token, str) for c in content)
    assert all(c.bytes is None or bytes(c.bytes).decode() == c.token for c in content)
    assert chat(oai, [sys(system), user("Hi")], max_tokens=2).choices[0].logprobs is None
    # Streamed: the final chunk carries them all.
    chunks = list(chat(oai, [sys(system), user("Hi")], max_tokens=4, logprobs=True, stream=True))
    streamed = [c.logprob for c in chunks[-1].choices[0].logprobs.content]
    assert streamed == pytest.approx(s["logprobs"], abs=1e-4)


def test_unsupported_parameters_are_400_unless_default(oai):
    messages = [sys("[unsupported-params] Options."), user("Hi")]
    for name, value in (("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"42": 5})):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, messages, max_tokens=1, extra_body={name: value})
        err = e.value.response.json()["error"]
        assert (err["param"], err["message"]) == (
            name, f"{name} {value!r} is not supported by this server; leave it out"), err
    r = chat(oai, messages, max_tokens=1, top_p=1, tool_choice="none", presence_penalty=0, frequency_penalty=0,
             logit_bias={}, response_format={"type": "text"}, user="someone")
    assert r.usage.completion_tokens == 1


def test_a_stream_whose_client_disconnects_is_cancelled_and_leaves_nothing(live, client, rt):
    """`/v1/chat/completions` with a `conversation_id`: the client reads one chunk
    of a long decode and leaves; the step stops and the conversation it created is gone."""
    import time

    import httpx

    body = {"messages": [sys("Disconnect on the OpenAI route."), user("Go on")], "max_tokens": 400, "stream": True,
            "conversation_id": "oai-disconnect", "create": True}
    with httpx.Client(base_url=live.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line)
    deadline = time.monotonic() + 60
    while rt.engine.stepping:
        assert time.monotonic() < deadline, "the abandoned step never stopped"
        time.sleep(0.02)
    assert client.get("/v1/conversations/oai-disconnect").status_code == 404
    rt.check_integrity()


def test_top_p_is_honoured(oai):
    """A tiny top_p keeps only the most likely token: sampling at a high
    temperature then gives the greedy tokens; top_p 1 does not."""
    messages = [sys("[top-p] Sampling."), user("Tell me something")]
    greedy = chat(oai, messages, max_tokens=8, temperature=0).choices[0].message
    nucleus = chat(oai, messages, max_tokens=8, temperature=5.0, top_p=1e-6, seed=1).choices[0].message
    wide = chat(oai, messages, max_tokens=8, temperature=5.0, top_p=1.0, seed=1).choices[0].message
    assert (nucleus.reasoning_content, nucleus.content) == (greedy.reasoning_content, greedy.content)
    assert (wide.reasoning_content, wide.content) != (greedy.reasoning_content, greedy.content)
    with pytest.raises(openai.BadRequestError):
        chat(oai, messages, max_tokens=1, top_p=0)


def test_top_logprobs_are_the_most_likely_tokens_best_first(oai):
    """Greedy: the chosen token is the first alternative, with the same logprob."""
    r = chat(oai, [sys("[top-logprobs] Alternatives."), user("Hi")], max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for tok in content:
        tops = tok.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert (tops[0].token, tops[0].logprob) == (tok.token, pytest.approx(tok.logprob, abs=1e-5))
    with pytest.raises(openai.BadRequestError):
        chat(oai, [sys("[top-logprobs] Alternatives."), user("Hi")], max_tokens=1, top_logprobs=2)  # needs logprobs


def test_the_sdks_stream_helper_and_its_types(oai, rt, monkeypatch):
    """`client.chat.completions.stream(...)`: every chunk validates as the SDK's
    ChatCompletionChunk, the final completion as ChatCompletion, and a forced
    tool call arrives whole in the helper's final message."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    real = rt.chat_step

    def chat_step(cid, request, **kw):
        kw["forced"] = {"reasoning": "Use the tool.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
        return real(cid, request, **kw)

    monkeypatch.setattr(rt, "chat_step", chat_step)
    messages = [sys("[stream-helper] The SDK's helper."), user("Weather in Oslo?")]
    with oai.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, max_tokens=4,
                                     stream_options={"include_usage": True}) as s:
        chunks = [e.chunk for e in s if e.type == "chunk"]
        final = s.get_final_completion()
    monkeypatch.undo()
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump(mode="json"), strict=True)
    ChatCompletion.model_validate(final.model_dump(mode="json", exclude={"choices": {0: {"message": {"parsed"}}}}))
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and final.id.startswith("chatcmpl-")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert final.usage.completion_tokens_details.reasoning_tokens == len(rt.tokenizer.encode_text("Use the tool.")) + 1
