"""`/v1/chat/completions` with `conversation_id` never loses a stored turn.

Two shapes continue a stored conversation: the full history as the client
echoes it, or only the new input. Anything else is 409 naming the message,
unless `"replace": true`; an unknown id is 404 unless `"create": true`; pending
tool calls are answered or refused; concurrent requests are serialized from the
history check to the commit. Every case is checked in memory (the runtime),
through GET, and, at the end of the module, after a restart on the same data
folder.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.api.conftest import served, step_ok

LAYERS = ("id", "system", "tenant", "tools", "trace", "history", "pending_tool_calls", "turns")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class State:
    data_dir: str
    live: object
    client: httpx.Client
    stored: dict[str, dict]  # conversation id -> its layers as the last test left them


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    s = State()
    s.data_dir = str(tmp_path_factory.mktemp("conversation-id"))
    s.stored = {}
    with served(data_dir=s.data_dir) as live, httpx.Client(base_url=live.url, timeout=120) as client:
        s.live, s.client = live, client
        yield s


def sys(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def chat(client, messages, cid, **extra):
    return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "conversation_id": cid,
                                                     **extra})


def layers(client, cid) -> dict:
    r = client.get(f"/v1/conversations/{cid}")
    assert r.status_code == 200, r.text
    return {k: r.json()[k] for k in LAYERS}


def echo(body: dict) -> dict:
    """The assistant message a client sends back, reasoning dropped."""
    m = body["choices"][0]["message"]
    out = {"role": "assistant", "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    return out


def two_turns(state, cid: str, system: str) -> list[dict]:
    """A two-turn conversation made through the full-history shape; returns the history a client holds."""
    c = state.client
    messages = [sys(system), user("First?")]
    r = step_ok(chat(c, messages, cid, create=True, tools=TOOLS))
    messages += [echo(r), user("Second?")]
    r = step_ok(chat(c, messages, cid, tools=TOOLS))
    return messages + [echo(r)]


def conflict(r: httpx.Response, message: str, param: str = "messages") -> None:
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "history_conflict", param), err
    assert err["message"].startswith(message), err["message"]


def test_only_the_new_user_message_continues_the_conversation(state):
    c, cid = state.client, "only-new"
    history = two_turns(state, cid, "[only-new] Keep everything.")
    before = layers(c, cid)
    full = chat(c, history + [user("Third?")], "only-new-full-twin", create=True, tools=TOOLS)  # a twin, for sizes
    r = step_ok(chat(c, [user("Third?")], cid))
    after = layers(c, cid)
    assert (after["system"], after["tools"]) == ("[only-new] Keep everything.", TOOLS)
    assert after["trace"][:4] == before["trace"] and after["turns"][:2] == before["turns"]
    assert [(t["role"], t["content"]) for t in after["trace"][4:]] == [
        ("user", "Third?"), ("assistant", r["choices"][0]["message"]["content"])]
    assert len(after["turns"]) == 3
    # Same prompt as the whole history would have rendered, and its stored prefix reused.
    assert r["usage"]["prompt_tokens"] == full.json()["usage"]["prompt_tokens"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Tools sent again, unchanged, are fine too.
    step_ok(chat(c, [user("Fourth?")], cid, tools=TOOLS))
    assert len(state.live.runtime.get(cid).turns) == 4
    state.stored[cid] = layers(c, cid)


def test_a_history_that_differs_is_409_and_changes_nothing(state):
    c, cid = state.client, "differs"
    system = "[differs] Refuse what is not the stored history."
    history = two_turns(state, cid, system)
    before = layers(c, cid)
    changed = [dict(m) for m in history]
    changed[3]["content"] = "Second, reworded?"
    cases = [
        # The case that used to wipe the conversation: a new client's first request under the id.
        (chat(c, [sys(system), user("Hello")], cid),
         "messages[1] is the new input, where the stored history goes on with a user message, in conversation "
         "'differs'", "messages"),
        (chat(c, history[:3] + [user("Behind?")], cid),
         "messages[3] is the new input, where the stored history goes on with a user message", "messages"),
        (chat(c, changed + [user("Third?")], cid), "messages[3] (user) differs from the stored user message of "
                                                   "conversation 'differs'", "messages"),
        (chat(c, history[1:] + [user("Third?")], cid),
         "messages[0]: the request has no system prompt, and conversation 'differs' has one", "messages"),
        (chat(c, [sys("[differs] Another.")] + history[1:] + [user("Third?")], cid),
         "messages[0]: the request's system prompt differs from that of conversation 'differs'", "messages"),
        (chat(c, history + [user("Third?"), {"role": "assistant", "content": "x"}, user("Fourth?")], cid),
         "messages[5] (user) is past the 4 stored messages of conversation 'differs'", "messages"),
        (chat(c, history + [user("Third?")], cid, tools=[]), "tools differ from those of conversation "
                                                             "'differs' (1 stored, 0 sent)", "tools"),
        (chat(c, [user("Third?")], cid, tools=TOOLS[:0] + [{**TOOLS[0], "function": {"name": "other"}}]),
         "tools differ", "tools"),
    ]
    for r, message, param in cases:
        conflict(r, message, param)
    assert layers(c, cid) == before
    r = chat(c, history + [user("Third?")], cid, stream=True)  # the stored history, streamed: it goes on
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    after = layers(c, cid)
    assert after["trace"][:4] == before["trace"] and len(after["turns"]) == 3
    streamed = c.post("/v1/chat/completions", json={"messages": [sys("[differs] Another."), user("x")],
                                                    "conversation_id": cid, "stream": True, "max_tokens": 2})
    conflict(streamed, "messages[0]: the request's system prompt differs")  # refused before the stream starts
    assert layers(c, cid) == after
    state.stored[cid] = after


def test_replace_is_explicit(state):
    c, cid = state.client, "replaced"
    two_turns(state, cid, "[replaced] Before.")
    r = step_ok(chat(c, [sys("[replaced] After."), user("Anew")], cid, replace=True))
    after = layers(c, cid)
    assert (after["system"], after["tools"], len(after["turns"])) == ("[replaced] After.", TOOLS, 1)
    assert [t["content"] for t in after["trace"]] == ["Anew", r["choices"][0]["message"]["content"]]
    state.stored[cid] = after


def test_pending_tool_calls_are_answered_or_refused_never_discarded(state):
    c, cid = state.client, "pending"
    r = c.post("/v1/conversations", json={"system": "[pending] A tool turn.", "tools": TOOLS})
    cid = r.json()["id"]
    step = step_ok(c.post(f"/v1/conversations/{cid}/messages", json={
        "content": "Weather?", "forced": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}}))
    call_id = step["tool_calls"][0]["id"]
    before = layers(c, cid)
    r = chat(c, [user("Never mind")], cid)
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        f"turn 0 waits for tool results: ['{call_id}']; answer them first")
    conflict(chat(c, [sys("[pending] A tool turn."), user("Weather?"), {"role": "assistant", "content": "Sunny."},
                      user("Thanks")], cid),
             "messages[2] (assistant) differs from the stored assistant message")
    r = chat(c, [{"role": "tool", "tool_call_id": "call_other", "content": "x"}], cid)
    assert r.status_code == 409 and "unknown or already answered tool calls: ['call_other']" in r.text
    assert layers(c, cid) == before
    r = step_ok(chat(c, [{"role": "tool", "tool_call_id": call_id, "content": "rain"}], cid))
    after = layers(c, cid)
    assert after["pending_tool_calls"] == [] and [t["role"] for t in after["trace"]] == [
        "user", "assistant", "tool", "assistant"]
    assert after["trace"][2] == {**after["trace"][2], "tool_call_id": call_id, "content": "rain"}
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    state.stored[cid] = after


def test_an_unknown_id_is_404_and_create_is_explicit(state):
    c = state.client
    r = chat(c, [sys("[unknown] x"), user("Hi")], "unknown-id")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "send \"create\": true" in r.json()["error"]["message"]
    assert c.get("/v1/conversations/unknown-id").status_code == 404
    assert "unknown-id" not in state.live.runtime.conversations
    step_ok(chat(c, [sys("[unknown] x"), user("Hi")], "unknown-id", create=True))
    # create on an existing conversation continues it under the same rules.
    conflict(chat(c, [sys("[unknown] x"), user("Hi")], "unknown-id", create=True), "messages[1] is the new input")
    r = chat(c, [user("Hi")], None, create=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "create"
    state.stored["unknown-id"] = layers(c, "unknown-id")


def test_a_lone_surrogate_in_an_earlier_message_is_400_and_changes_nothing(state):
    c, cid = state.client, "surrogate"
    history = two_turns(state, cid, "[surrogate] Unicode.")
    before = layers(c, cid)
    bad = [dict(m) for m in history]
    bad[1]["content"] = "First?\ud800"
    for extra in ({}, {"replace": True}):
        body = json.dumps({"messages": bad + [user("Third?")], "conversation_id": cid, "max_tokens": 2, **extra})
        assert "\\ud800" in body
        r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "messages[1] is not valid Unicode: surrogates not allowed"
    assert layers(c, cid) == before
    state.stored[cid] = before


def test_a_failed_step_leaves_the_conversation_as_it_was(state):
    c, cid = state.client, "failed"
    history = two_turns(state, cid, "[failed] A step over the context.")
    before = layers(c, cid)
    for messages, extra in (([user("word " * 600)], {}), (history + [user("word " * 600)], {}),
                            ([sys("[failed] Replaced."), user("word " * 600)], {"replace": True})):
        r = chat(c, messages, cid, **extra)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
        assert layers(c, cid) == before
    state.stored[cid] = before


def test_concurrent_requests_are_serialized_and_each_200_is_stored_once(state):
    c, cid = state.client, "concurrent"
    history = two_turns(state, cid, "[concurrent] Eight clients.")
    n = 8

    def run(bodies: list[dict]) -> list[httpx.Response]:
        out: list = [None] * len(bodies)
        go = threading.Barrier(len(bodies))

        def one(i: int) -> None:
            with httpx.Client(base_url=state.live.url, timeout=300) as own:
                go.wait()
                out[i] = own.post("/v1/chat/completions", json=bodies[i])
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    # Eight clients that all saw the same two turns: one turn goes on, the others are told.
    answers = run([{"messages": history + [user(f"Full {i}?")], "conversation_id": cid, "max_tokens": 2}
                   for i in range(n)])
    assert sorted(r.status_code for r in answers) == [200] + [409] * (n - 1)
    winner = next(i for i, r in enumerate(answers) if r.status_code == 200)
    d = layers(c, cid)
    assert [t["content"] for t in d["trace"] if t["role"] == "user"] == ["First?", "Second?", f"Full {winner}?"]

    # Eight clients that send only their new message: each one's turn is stored once, one after another.
    answers = run([{"messages": [user(f"Only {i}?")], "conversation_id": cid, "max_tokens": 2} for i in range(n)])
    assert [r.status_code for r in answers] == [200] * n
    d = layers(c, cid)
    users = [t["content"] for t in d["trace"] if t["role"] == "user"][3:]
    assert sorted(users) == sorted(f"Only {i}?" for i in range(n))
    assert [t["role"] for t in d["trace"]] == ["user", "assistant"] * (3 + n)
    assert len(d["turns"]) == 3 + n and all(len(t["steps"]) == 1 for t in d["turns"])
    # Each 200 is the turn stored at its place: its accounting is that turn's.
    by_user = {users[k]: d["turns"][3 + k]["steps"][0] for k in range(n)}
    for i, r in enumerate(answers):
        assert r.json()["accounting"] == by_user[f"Only {i}?"]
    state.live.runtime.check_integrity()
    state.stored[cid] = d


def test_everything_is_as_stored_after_a_restart(state):
    """The last test of the module: a new runtime on the same data folder."""
    assert len(state.stored) == 8
    state.live.stop()
    state.live.runtime.close()
    with served(data_dir=state.data_dir) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        for cid, stored in state.stored.items():
            assert layers(c, cid) == stored, cid
        conflict(chat(c, [sys("[only-new] Keep everything."), user("Hello")], "only-new"), "messages[1] is the new")
        r = step_ok(chat(c, [user("After the restart?")], "only-new"))
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # KV is never stored
        assert len(layers(c, "only-new")["turns"]) == 5
