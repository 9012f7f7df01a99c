"""Persistence over a restart: with `data_dir` set, conversations survive the
server and the Runtime; a NEW Runtime and server on the same data_dir serve the
same trace, history and turns. KV is never stored: the first step after the
restart prefills everything (cached_input_tokens == 0), and a pending tool
call is answered after the restart.

The module builds its own runtimes (pool 16384, context 512, page 16): the
first writes, the second reads and goes on, a third checks that what the
second did was stored too.
"""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import create, error_of, first_prompt_len, served, step_ok

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
FORCED = {"reasoning": "Think about it.", "content": "The answer is 42."}
LAYERS = ("id", "system", "tenant", "template", "policy", "keep_last_k", "materialize", "tools", "trace", "history",
          "pending_tool_calls", "turns")


def msg(client, cid, **body):
    return client.post(f"/v1/conversations/{cid}/messages", json=body)


def results(client, cid, **body):
    return client.post(f"/v1/conversations/{cid}/tool_results", json=body)


def layers(body: dict) -> dict:
    return {k: body[k] for k in LAYERS}


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """Run conversations on a first server, stop it and close its Runtime, then
    start a new Runtime and server on the same data_dir."""
    data_dir = str(tmp_path_factory.mktemp("session-data"))
    before = {}
    with served(data_dir=data_dir) as s1, httpx.Client(base_url=s1.url, timeout=120) as c:
        ids = {
            "keep": create(c, system="Persisted, keep policy.", policy="keep", tenant="acme"),
            "drop": create(c, system="Persisted, drop policy.", materialize="never"),
            "tools": create(c, system="Persisted, waiting for a tool.", policy="keep",
                            tools=[{"type": "function", "function": {"name": "get_weather"}}]),
            "gone": create(c, system="Persisted, then deleted."),
            "empty": create(c, system="Persisted, never used."),
        }
        step_ok(msg(c, ids["keep"], content="Hello", forced=FORCED))
        step_ok(msg(c, ids["keep"], content="Hello again", max_tokens=5))
        step_ok(msg(c, ids["drop"], content="Hello", forced=FORCED))
        step_ok(msg(c, ids["tools"], content="Weather?", forced={"reasoning": "Use the tool.", "tool_calls": [WEATHER]}))
        step_ok(msg(c, ids["gone"], content="Hello", forced=FORCED))
        assert c.delete(f"/v1/conversations/{ids['gone']}").status_code == 200
        # The OpenAI endpoint's conversations are stored too.
        c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Persisted via OpenAI."},
                                                          {"role": "user", "content": "Hi"}],
                                             "max_tokens": 3, "conversation_id": "oa-persisted",
                                             "create": True}).raise_for_status()
        ids["openai"] = "oa-persisted"
        for name, cid in ids.items():
            if name != "gone":
                before[name] = c.get(f"/v1/conversations/{cid}", params={"tokens": 1}).json()
        s1.runtime.check_integrity()
    # s1 is stopped and its Runtime closed here.
    with served(data_dir=data_dir) as s2, httpx.Client(base_url=s2.url, timeout=120) as c:
        yield {"ids": ids, "before": before, "runtime": s2.runtime, "client": c, "data_dir": data_dir}
        s2.runtime.check_integrity()


def test_get_after_restart_returns_the_same_layers(restarted):
    c, ids, before = restarted["client"], restarted["ids"], restarted["before"]
    assert set(restarted["runtime"].conversations) == {cid for name, cid in ids.items() if name != "gone"}
    for name, body in before.items():
        after = c.get(f"/v1/conversations/{ids[name]}").json()
        assert layers(after) == layers(body), name
        # The KV is gone: nothing is cached, and the chain is rebuilt on the next step.
        assert (after["chain"]["sequence_tokens"], after["chain"]["cached_tokens"], after["chain"]["kind"]) == (
            0, 0, "none")
    assert before["tools"]["pending_tool_calls"] == [{"id": "call_0_0_0", **WEATHER}]
    assert [t["closed"] for t in before["keep"]["turns"]] == [True, True]
    assert before["drop"]["history"][1]["reasoning"] == "" and before["drop"]["trace"][1]["reasoning"] == "Think about it."
    error_of(c.get(f"/v1/conversations/{ids['gone']}"), 404, "not_found")
    assert c.get("/debug/tree").json()["chains"] == {cid: 0 for cid in restarted["runtime"].conversations}
    restarted["runtime"].check_integrity()


def test_next_message_after_restart_prefills_everything(restarted):
    c, ids, before, rt = restarted["client"], restarted["ids"], restarted["before"], restarted["runtime"]
    enc = rt.tokenizer.encode

    # keep: the next prompt is the whole generated sequence plus the new message.
    seq = before["keep"]["chain"]["sequence_tokens"]
    assert seq == len(before["keep"]["chain"]["token_ids"]) == 32
    # Turn 1 stopped at max_tokens: its last sampled token was never fed (no KV),
    # and the template closes the message with eos, so the canonical history is
    # the computed sequence plus 2 tokens.
    history = before["keep"]["turns"][1]["steps"][0]["active_context_length"]
    assert before["keep"]["turns"][1]["steps"][0]["output_tokens"] == 5 and history == seq + 2
    s = step_ok(msg(c, ids["keep"], content="After the restart", forced={"content": "Still here."}))
    a = s["accounting"]
    assert (s["turn"], s["step"]) == (2, 0)
    prompt = history + 1 + len(enc("After the restart")) + 2
    assert (a["prompt_tokens"], a["cached_input_tokens"], a["uncached_prefill_tokens"]) == (prompt, 0, prompt)
    assert (a["recomputed_history_tokens"], a["cache_state"]) == (history, "none")
    withids = c.get(f"/v1/conversations/{ids['keep']}", params={"tokens": 1}).json()
    # The rebuilt chain starts with the stored sequence, token for token.
    assert withids["chain"]["token_ids"][:seq] == before["keep"]["chain"]["token_ids"]
    # keep holds its chain, partial last page included (private): exact length.
    assert withids["chain"]["cached_tokens"] == len(withids["chain"]["token_ids"]) == 45
    # ... and the step after that reuses the rebuilt KV.
    s = step_ok(msg(c, ids["keep"], content="Once more", forced={"content": "ok"}))
    assert s["accounting"]["cached_input_tokens"] == withids["chain"]["cached_tokens"] > 0

    # drop: the canonical history (no reasoning) is what gets prefilled.
    canonical = before["drop"]["turns"][0]["steps"][0]["active_context_length"]
    s = step_ok(msg(c, ids["drop"], content="After the restart", forced=FORCED))
    a = s["accounting"]
    assert (a["prompt_tokens"], a["cached_input_tokens"]) == (canonical + 1 + len(enc("After the restart")) + 2, 0)
    assert a["recomputed_history_tokens"] == canonical

    # Conversations created before the restart and never used work too.
    s = step_ok(msg(c, ids["empty"], content="Hello", forced=FORCED))
    assert s["accounting"]["prompt_tokens"] == first_prompt_len(rt, "Persisted, never used.", "Hello")
    rt.check_integrity()


def test_pending_tool_call_survives_the_restart(restarted):
    c, ids, before, rt = restarted["client"], restarted["ids"], restarted["before"], restarted["runtime"]
    cid = ids["tools"]
    assert c.get(f"/v1/conversations/{cid}").json()["pending_tool_calls"] == [{"id": "call_0_0_0", **WEATHER}]
    error_of(msg(c, cid, content="Are you there?"), 409, "conflict")
    error_of(results(c, cid, results=[{"tool_call_id": "call_0_0_1"}]), 409, "conflict")
    seq = before["tools"]["chain"]["sequence_tokens"]
    s = step_ok(results(c, cid, results=[{"tool_call_id": "call_0_0_0", "content": "sunny"}],
                        forced={"content": "Sunny."}))
    assert (s["turn"], s["step"], s["finish_reason"]) == (0, 1, "forced")
    a = s["accounting"]
    text = "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n"
    prompt = seq + len(rt.tokenizer.encode(text)) + 1  # + <think>: the open turn keeps its reasoning
    assert (a["prompt_tokens"], a["cached_input_tokens"], a["uncached_prefill_tokens"]) == (prompt, 0, prompt)
    d = c.get(f"/v1/conversations/{cid}").json()
    assert d["pending_tool_calls"] == [] and d["turns"][0]["closed"]
    assert [t["role"] for t in d["trace"]] == ["user", "assistant", "tool", "assistant"]
    assert d["turns"][0]["steps"][0] == before["tools"]["turns"][0]["steps"][0]
    rt.check_integrity()


def test_openai_conversation_survives_the_restart(restarted):
    c, before = restarted["client"], restarted["before"]
    b = before["openai"]
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Persisted via OpenAI."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": b["trace"][1]["content"],
                      "reasoning_content": b["trace"][1]["reasoning"]},
                     {"role": "user", "content": "Again"}],
        "max_tokens": 2, "conversation_id": "oa-persisted"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    d = c.get("/v1/conversations/oa-persisted").json()
    assert d["turns"][0] == b["turns"][0] and len(d["turns"]) == 2  # same history: kept, not replaced


def test_steps_after_the_restart_are_stored_too(restarted):
    """Runs last in this module: a third Runtime on the same data_dir (read only
    here) sees what the second one did."""
    c, ids = restarted["client"], restarted["ids"]
    now = {name: c.get(f"/v1/conversations/{cid}").json() for name, cid in ids.items() if name != "gone"}
    from tests.api.conftest import build_runtime

    rt3 = build_runtime(data_dir=restarted["data_dir"])
    try:
        for name, body in now.items():
            assert layers(rt3.describe(ids[name])) == layers(body), name
    finally:
        rt3.close()


def test_the_data_file_is_its_owners_only(tmp_path):
    """Every tenant's conversations are in one file: mode 0600 (its WAL and
    shared-memory files too), in a new folder of mode 0700, whatever the umask;
    a file an older version left readable is tightened."""
    import os
    import stat

    from session_runtime.conversation import Conversation
    from session_runtime.offload import OffloadSettings
    from session_runtime.policies import MaterializeSettings, ReasoningPolicy
    from session_runtime.store.sqlite import Store

    def mode(p) -> int:
        return stat.S_IMODE(os.stat(p).st_mode)

    old = os.umask(0o002)
    try:
        path = tmp_path / "new" / "conversations.sqlite3"
        store = Store(path)
        store.save(Conversation(id="c1", system="secret", tools=[], tenant="a", template="deepseek",
                                policy=ReasoningPolicy("drop", 1), materialize=MaterializeSettings("auto"),
                                offload=OffloadSettings("never")))
        files = sorted(p.name for p in path.parent.iterdir())
        assert files == ["conversations.sqlite3", "conversations.sqlite3-shm", "conversations.sqlite3-wal"]
        assert {f: mode(path.parent / f) for f in files} == dict.fromkeys(files, 0o600)
        assert mode(path.parent) == 0o700
        assert [c.system for c in store.load_all()] == ["secret"]
        store.close()

        legacy = tmp_path / "legacy.sqlite3"
        legacy.touch(mode=0o644)
        os.chmod(legacy, 0o644)
        Store(legacy).close()
        assert mode(legacy) == 0o600
    finally:
        os.umask(old)


def test_a_stateless_client_goes_on_after_the_restart(tmp_path):
    """A harness's conversation (stateless requests, each with the whole
    history) is found again after a restart: by its history's digest, stored
    with each step, not by this process's index, which starts empty; it is
    known to the idle TTL from the start."""
    data_dir = str(tmp_path / "data")
    messages = [{"role": "system", "content": "Stateless, persisted."}, {"role": "user", "content": "Hi"}]

    def turn(c) -> str:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
        assert r.status_code == 200, r.text
        messages.extend([{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"more {len(messages)}"}])
        return r.headers["x-session-runtime-conversation"]

    with served(data_dir=data_dir) as s1, httpx.Client(base_url=s1.url, timeout=120) as c:
        cid = turn(c)
        assert turn(c) == cid
        last = {"messages": messages[:-2], "max_tokens": 3}  # the last request, as its retry sends it again
        answered = messages[-2]["content"]
    with served(data_dir=data_dir, session_idle_ttl_s=3600) as s2, httpx.Client(base_url=s2.url, timeout=120) as c:
        assert cid in s2.runtime.sessions  # seeded from the store
        # A retry of the step the first process ran: its answer as stored, no second turn.
        r = c.post("/v1/chat/completions", json=last)
        assert r.status_code == 200 and r.headers["x-session-runtime-conversation"] == cid
        assert r.json()["choices"][0]["message"]["content"] == answered
        assert len(c.get(f"/v1/conversations/{cid}").json()["turns"]) == 2
        assert s2.runtime.sessions.matched["retry"] == 1
        assert turn(c) == cid
        d = c.get(f"/v1/conversations/{cid}").json()
        assert d["inferred"] == "openai-chat" and len(d["turns"]) == 3
        s2.runtime.check_integrity()
