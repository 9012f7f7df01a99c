"""Conformance: the same session-API behaviour on both backends, over real
loopback HTTP. The embedded engine and SGLang's real server (our `session`
radix-cache backend in its scheduler) serve the same model folder with the
same page (16), pool (2048 tokens) and context (4096); every test runs on
both, and the exact numbers are the same on both.
"""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from tests.api.conftest import create, error_of, snapshot, start_server, step_ok
from tests.api.test_session_api import forced_len, msg, results
from tests.conftest import SGLANG_CONTEXT, SGLANG_POOL

PAGE = 16
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
THINK = ("The user wants the weather in Paris. I have a weather tool; I should call it with the city "
         "and then report the temperature and the sky in one short sentence. ") * 3


@pytest.fixture(scope="session", params=["embedded", "sglang"])
def backend_live(request):
    rt = request.getfixturevalue("embedded_twin" if request.param == "embedded" else "sglang_runtime")
    live = start_server(rt)
    yield live
    live.stop()


@pytest.fixture
def client(backend_live):
    """A client of the backend's server; after the test its integrity is checked
    and its conversations deleted (the shared pool holds 2048 tokens)."""
    rt = backend_live.runtime
    with httpx.Client(base_url=backend_live.url, timeout=300) as c:
        yield c
    rt.check_integrity()
    for cid in list(rt.conversations):
        rt.delete_conversation(cid)
    rt.check_integrity()


def _system() -> str:
    return f"You are a weather agent {uuid.uuid4().hex[:8]}."


def tool_chain(client, rt, system: str, policy: str = "drop", think: str = THINK,
               tools: list = TOOLS) -> tuple[str, list[dict], dict]:
    """A turn with one tool call, then a second turn's first step (forced)."""
    cid = create(client, system=system, tools=tools, policy=policy, materialize="never")
    s1 = step_ok(msg(client, cid, content="What is the weather in Paris?", forced={
        "reasoning": think, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}))
    assert s1["finish_reason"] == "tool_calls"
    call = s1["tool_calls"][0]["id"]
    s2 = step_ok(results(client, cid, results=[{"tool_call_id": call, "content": "18 C, sunny"}], forced={
        "reasoning": "The tool says 18 C and sunny.", "content": "It is 18 C and sunny in Paris."}))
    s3 = step_ok(msg(client, cid, content="And tomorrow?", forced={"reasoning": "No tool needed.",
                                                                   "content": "I cannot tell tomorrow's weather."}))
    conv = client.get(f"/v1/conversations/{cid}").json()
    return cid, [s1["accounting"], s2["accounting"], s3["accounting"]], conv


def test_tool_chain_continuation_and_turn_two_reuse(client, backend_live):
    rt = backend_live.runtime
    cid, (a1, a2, a3), conv = tool_chain(client, rt, _system())
    seq1 = a1["active_context_length"]
    assert seq1 == a1["prompt_tokens"] + forced_len(rt, {"reasoning": THINK, "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]})
    assert a1["cached_input_tokens"] == 0 and a1["uncached_prefill_tokens"] == a1["prompt_tokens"]
    # The tool step continues the exact sequence: all of it is reused, its
    # partial last page too (kept private for the chain).
    assert a2["logical_reusable_tokens"] == a2["cached_input_tokens"] == seq1
    assert a2["alignment_loss_tokens"] == 0 and a2["recomputed_history_tokens"] == 0
    assert a2["uncached_prefill_tokens"] == a2["prompt_tokens"] - seq1
    # Turn 2 under drop: the prompt forks where turn 1's reasoning was; the
    # chain was held at the fork (its partial page copied), so all of it is reused.
    fork = conv["turns"][0]["fork_tokens"]
    assert 0 < fork < a1["prompt_tokens"] + 1
    assert a3["logical_reusable_tokens"] == fork
    assert a3["cached_input_tokens"] == fork and a3["alignment_loss_tokens"] == 0
    assert a3["recomputed_history_tokens"] == conv["turns"][0]["steps"][-1]["active_context_length"] - fork
    assert a3["cache_state"] == "prefix_only"
    # Turn 2 closed too: the chain now holds turn 2's fork, exactly.
    assert conv["chain"]["cached_tokens"] == conv["turns"][1]["fork_tokens"]
    tree = client.get("/debug/tree", params={"conversation": cid}).json()
    assert tree["chains"][cid] == conv["chain"]["cached_tokens"]
    owned = [n for n in tree["nodes"] if cid in n["owners"]]
    # Tree nodes hold whole pages; the partial last page is the chain's private one.
    assert sum(n["tokens"] for n in owned) == conv["chain"]["cached_tokens"] // PAGE * PAGE
    assert all(n["residency"] == "device" and n["lock_count"] >= 1 for n in owned)


_KEYS = ("prompt_tokens", "cached_input_tokens", "uncached_prefill_tokens", "logical_reusable_tokens",
         "alignment_loss_tokens", "recomputed_history_tokens", "active_context_length", "output_tokens",
         "kv_device_bytes", "cache_state", "counterfactual")


_POLICIES = ("drop", "keep", "auto", "strip_thinking_cache", "engine_default")


def test_both_backends_account_the_same(embedded_twin, sglang_runtime):
    """The same scenario through each backend's Python API gives the same numbers
    (policy auto's choices too, on a clock that stands still on both)."""
    figures = {}
    for name, rt in (("embedded", embedded_twin), ("sglang", sglang_runtime)):
        live = start_server(rt)
        wall, rt.auto.outlooks.clock = rt.auto.outlooks.clock, lambda: 0.0
        try:
            with httpx.Client(base_url=live.url, timeout=300) as c:
                for policy in _POLICIES:
                    cid, steps, conv = tool_chain(c, rt, f"You are the same {policy} agent on both backends.",
                                                  policy=policy)
                    figures[name, policy] = ([{k: a[k] for k in _KEYS} for a in steps],
                                             conv["chain"]["cached_tokens"], [t["fork_tokens"] for t in conv["turns"]],
                                             [t["auto"] and t["auto"]["choice"] for t in conv["turns"]])
                    rt.delete_conversation(cid)
        finally:
            rt.auto.outlooks.clock = wall
            live.stop()
    for policy in _POLICIES:
        assert figures["embedded", policy] == figures["sglang", policy], policy
    assert all(figures["sglang", "auto"][3]), "auto chose for every closed turn"


def test_keep_policy_reuses_the_whole_generated_turn(client, backend_live):
    cid, (a1, a2, a3), conv = tool_chain(client, backend_live.runtime, _system(), policy="keep")
    held = conv["turns"][0]["steps"][-1]["active_context_length"]
    assert a3["cached_input_tokens"] == held
    assert a3["cache_state"] == "generated_branch"


def test_error_cases_change_nothing(client, backend_live):
    rt = backend_live.runtime
    cid = create(client, system=_system(), tools=TOOLS)
    s1 = step_ok(msg(client, cid, content="Weather in Paris?", forced={
        "reasoning": "Call the tool.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}))
    before = snapshot(client, cid)
    error_of(msg(client, "no-such-conversation", content="Hi"), 404, "not_found")
    error_of(msg(client, cid, content="Hello?"), 409, "conflict")  # tool calls are pending
    error_of(results(client, cid, results=[{"tool_call_id": "call_x", "content": "?"}]), 409, "conflict")
    error_of(results(client, cid, results=[]), 422)
    error_of(msg(client, cid, content="   "), 422)
    assert client.post(f"/v1/conversations/{cid}/messages", json={"content": 5}).status_code == 422
    # A prompt over the context limit is 413; one the pool can never hold, 507.
    huge, big = "a" + " a" * (SGLANG_CONTEXT + 10), "a" + " a" * (SGLANG_POOL + 200)
    call = s1["tool_calls"][0]["id"]
    error_of(results(client, cid, results=[{"tool_call_id": call, "content": huge}]), 413, "context_too_long")
    message = error_of(results(client, cid, results=[{"tool_call_id": call, "content": big}], max_tokens=1), 507,
                       "pool_exhausted")
    assert "KV slots" in message
    assert snapshot(client, cid) == before
    rt.check_integrity()
    # And the conversation goes on as if nothing had happened.
    s2 = step_ok(results(client, cid, results=[{"tool_call_id": call, "content": "18 C"}],
                         forced={"content": "18 C."}))
    assert s2["accounting"]["cached_input_tokens"] == s1["accounting"]["active_context_length"]


def test_sampled_steps_stream_and_delete(client, backend_live):
    cid = create(client, system=_system())
    plain = step_ok(msg(client, cid, content="Say something.", max_tokens=6))
    assert 1 <= plain["accounting"]["output_tokens"] <= 6
    with client.stream("POST", f"/v1/conversations/{cid}/messages",
                       json={"content": "Again.", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and any('"step"' in line for line in lines)
    assert client.delete(f"/v1/conversations/{cid}").status_code == 200
    assert cid not in client.get("/debug/tree").json()["chains"]
    error_of(client.get(f"/v1/conversations/{cid}"), 404, "not_found")


def test_chat_completions_continue_the_chain(client, backend_live):
    cid = f"chat-{uuid.uuid4().hex[:8]}"
    body = {"model": backend_live.runtime.model_id, "max_tokens": 4, "conversation_id": cid, "create": True,  # the served one
            "messages": [{"role": "system", "content": "You are terse; this system prompt fills a whole page. "
                                                       + _system()}, {"role": "user", "content": "Hi"}]}
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]
    body["messages"] += [{"role": "assistant", "content": reply["content"],
                          "reasoning_content": reply.get("reasoning_content")},
                         {"role": "user", "content": "More"}]
    second = client.post("/v1/chat/completions", json=body)
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_concurrent_conversations(client, backend_live):
    """Eight agents at once, each with a tool turn: all succeed, nothing leaks."""
    url, errors, done = backend_live.url, [], []

    def agent(i):
        try:
            with httpx.Client(base_url=url, timeout=300) as c:
                _, steps, conv = tool_chain(c, backend_live.runtime, f"Agent {i} {uuid.uuid4().hex[:6]}.",
                                            think="Call the weather tool.", tools=[])
                assert steps[1]["cached_input_tokens"] == steps[0]["active_context_length"]
                done.append(conv["id"])
        except Exception as exc:  # collected and reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(done) == 8
    chains = client.get("/debug/tree").json()["chains"]
    assert all(chains[cid] > 0 for cid in done)


def test_baselines_cache_as_sglang_does(client, backend_live):
    """engine_default holds no chain (the tree keeps the branch until LRU);
    strip_thinking_cache caches only each step's prompt, so the tool step
    recomputes the whole previous output."""
    cid, (a1, a2, _), conv = tool_chain(client, backend_live.runtime, _system(), policy="strip_thinking_cache")
    assert a2["cached_input_tokens"] == a1["prompt_tokens"] // PAGE * PAGE
    assert a2["recomputed_history_tokens"] == a1["active_context_length"] - a1["prompt_tokens"] // PAGE * PAGE
    assert client.get("/debug/tree").json()["chains"][cid] == 0
    cid, (a1, a2, _), conv = tool_chain(client, backend_live.runtime, _system(), policy="engine_default")
    assert a2["cached_input_tokens"] == a1["active_context_length"] // PAGE * PAGE
    assert client.get("/debug/tree").json()["chains"][cid] == 0


def test_canonical_branch_in_idle_time(client, backend_live):
    rt = backend_live.runtime
    cid = create(client, system=_system(), policy="drop", materialize="always")
    # The answer spans more than a page past the prompt, so the canonical branch
    # is reused beyond P whatever the prompt's own length.
    step_ok(msg(client, cid, content="What is 2+2?", forced={"reasoning": THINK, "content": "2 + 2 = 4. " * 8}))
    assert rt.materializer.run_pending() == 1  # the test's idle time
    conv = client.get(f"/v1/conversations/{cid}").json()
    canonical = conv["turns"][0]["steps"][-1]["active_context_length"]
    assert conv["chain"]["cached_tokens"] == canonical
    assert conv["turns"][0]["materialized_prefill_tokens"] == canonical - conv["turns"][0]["fork_tokens"]
    a = step_ok(msg(client, cid, content="And 3+3?", forced={"content": "6."}))["accounting"]
    assert a["cache_state"] == "canonical_branch"
    assert a["cached_input_tokens"] == canonical
    assert a["recomputed_history_tokens"] == 0
