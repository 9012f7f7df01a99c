"""The session HTTP API over real loopback HTTP: create/get/delete, steps with
forced output, logprobs and tool results, /debug/tree, /metrics, /health; every
error case (shape, status, and a conversation left exactly as it was); SSE
streaming, a client that disconnects mid-stream; and concurrency.

The shared server (tests/api/conftest.py) runs the 'tiny' preset with page 16,
pool 16384 tokens and context 512. Exact token counts come from the DeepSeek
tokenizer and the template's layout:

    bos {system} <User> {content} <Assistant> <think>   (the first prompt)
    {reasoning} </think> {content}[DSML tool calls] eos (a forced output)
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from session_runtime.errors import InvalidRequest

from tests.api.conftest import (
    MAX_CONTEXT,
    PAGE,
    TINY_BYTES_PER_TOKEN,
    create,
    error_of,
    first_prompt_len,
    metrics,
    pool_state,
    served,
    snapshot,
    sse_events,
    step_ok,
    stream,
)

FORCED = {"reasoning": "Think about it.", "content": "The answer is 42."}
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
TIME = {"name": "get_time", "arguments": {"zone": "UTC", "precise": True}}


def msg(client, cid, **body) -> httpx.Response:
    return client.post(f"/v1/conversations/{cid}/messages", json=body)


def results(client, cid, **body) -> httpx.Response:
    return client.post(f"/v1/conversations/{cid}/tool_results", json=body)


def results_len(rt, contents) -> int:
    """Tokens of the rendered tool results, `<think>` included (the open turn keeps reasoning)."""
    text = "\n\n<function_results>" + "".join(f"\n<result>{c}</result>" for c in contents) + "\n</function_results>\n\n"
    return len(rt.tokenizer.encode(text)) + 1


def forced_len(rt, forced) -> int:
    calls = forced.get("tool_calls", ())
    from session_runtime.templates import ToolCall

    return len(rt.template("deepseek").forced_ids(
        forced.get("reasoning", ""), forced.get("content", ""),
        [ToolCall("", c["name"], c.get("arguments", {})) for c in calls]))


# ----- health, create, get, delete ------------------------------------------------


def test_health(client):
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "model": "tiny", "device": "cpu", "backend": "embedded"}


def test_create_returns_201_with_every_field(client, rt):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    r = client.post("/v1/conversations", json={
        "system": "Create with every field.", "tools": tools, "tenant": "acme", "policy": "keep_last_k",
        "keep_last_k": 2, "materialize": "never", "template": "deepseek", "continue_probability": 0.25,
        "offload": "ttl", "ttl_s": 5.0,
    })
    assert r.status_code == 201
    body = r.json()
    cid = body["id"]
    assert isinstance(cid, str) and cid
    expected = {
        "system": "Create with every field.", "tenant": "acme", "template": "deepseek", "policy": "keep_last_k",
        "keep_last_k": 2, "materialize": "never", "tools": tools, "trace": [], "history": [],
        "pending_tool_calls": [], "turns": [], "offload": "ttl",
    }
    assert {k: body[k] for k in expected} == expected
    assert {k: body["chain"][k] for k in ("sequence_tokens", "cached_tokens", "kind", "kv_device_bytes")} == {
        "sequence_tokens": 0, "cached_tokens": 0, "kind": "none", "kv_device_bytes": 0}
    assert client.get(f"/v1/conversations/{cid}").json() == body
    assert rt.get(cid).materialize.continue_probability == 0.25 and rt.get(cid).offload.ttl_s == 5.0

    d = client.post("/v1/conversations", json={})
    assert d.status_code == 201
    d = d.json()
    assert (d["system"], d["tenant"], d["template"], d["policy"], d["keep_last_k"], d["materialize"], d["tools"]) == (
        None, None, "deepseek", "drop", 1, "auto", [])
    assert d["id"] != cid


def test_tools_are_rendered_into_the_prompt(client, rt):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = create(client, system="Tools in the prompt.")
    with_tools = create(client, system="Tools in the prompt.", tools=tools)
    a = step_ok(msg(client, plain, content="Hi", forced={"content": "ok"}))["accounting"]
    b = step_ok(msg(client, with_tools, content="Hi", forced={"content": "ok"}))["accounting"]
    assert a["prompt_tokens"] == first_prompt_len(rt, "Tools in the prompt.", "Hi")
    # The official encoder's prompt, tokenized whole (tests/session_runtime/test_template_fidelity.py).
    from sglang.srt.entrypoints.openai.encoding_dsv32 import encode_messages

    official = encode_messages([{"role": "system", "content": "Tools in the prompt.", "tools": tools},
                                {"role": "user", "content": "Hi"}], thinking_mode="thinking")
    assert b["prompt_tokens"] == len(rt.tokenizer.encode(official))
    # The two prompts differ right after the system text, inside the first page.
    assert b["cached_input_tokens"] == 0


def test_forced_turns_get_and_token_ids(client, rt):
    system = "HTTP forced turns."
    cid = create(client, system=system, policy="keep", tenant="forced-turns")  # a namespace of its own
    tpl = rt.template("deepseek")
    enc = rt.tokenizer.encode
    assert len(enc(system)) == 4 and len(tpl.forced_ids(FORCED["reasoning"], FORCED["content"])) == 12

    s1 = step_ok(msg(client, cid, content="Hello", forced=FORCED))
    assert {k: s1[k] for k in ("conversation_id", "turn", "step", "reasoning", "content", "tool_calls",
                               "finish_reason", "logprobs")} == {
        "conversation_id": cid, "turn": 0, "step": 0, "reasoning": "Think about it.",
        "content": "The answer is 42.", "tool_calls": [], "finish_reason": "forced", "logprobs": None}
    a = s1["accounting"]
    # bos + 4 system + <User> Hello <Assistant> + <think> = 9; + 12 forced = 21 computed, all
    # held by the keep chain: one tree page (16) plus its private partial page (5).
    assert (a["prompt_tokens"], a["cached_input_tokens"], a["uncached_prefill_tokens"], a["output_tokens"]) == (9, 0, 9, 12)
    assert (a["logical_reusable_tokens"], a["alignment_loss_tokens"], a["recomputed_history_tokens"]) == (0, 0, 0)
    assert (a["active_context_length"], a["attention_work"], a["host_loaded_tokens"], a["kv_host_bytes"]) == (21, 45, 0, 0)
    assert a["kv_device_bytes"] == 21 * TINY_BYTES_PER_TOKEN
    assert a["cache_state"] == "none"
    assert a["counterfactual"] == {"keep": {"prompt_tokens": 9, "prefill_tokens": 9, "context_tokens": 9},
                                   "drop": {"prompt_tokens": 9, "prefill_tokens": 9, "context_tokens": 9}}

    s2 = step_ok(msg(client, cid, content="Hello there", forced=FORCED))
    a2 = s2["accounting"]
    # 21 + <User> Hello there <Assistant> + <think> = 26; all 21 reused (its own
    # chain's private page continues the tree's page exactly), nothing recomputed.
    assert (s2["turn"], s2["step"]) == (1, 0)
    assert (a2["prompt_tokens"], a2["cached_input_tokens"], a2["uncached_prefill_tokens"]) == (26, 21, 5)
    assert (a2["logical_reusable_tokens"], a2["alignment_loss_tokens"], a2["recomputed_history_tokens"]) == (21, 0, 0)
    assert a2["attention_work"] == 5 * 21 + 5 * 6 // 2
    assert (a2["active_context_length"], a2["kv_device_bytes"]) == (38, 38 * TINY_BYTES_PER_TOKEN)
    assert a2["cache_state"] == "generated_branch"

    d = client.get(f"/v1/conversations/{cid}").json()
    assert "token_ids" not in d["chain"]
    assert {k: d["chain"][k] for k in ("sequence_tokens", "cached_tokens", "kind", "kv_device_bytes")} == {
        "sequence_tokens": 38, "cached_tokens": 38, "kind": "generated", "kv_device_bytes": 38 * TINY_BYTES_PER_TOKEN}
    assert [(t["turn"], t["role"], t["content"], t.get("reasoning"), t.get("step"), t.get("finish_reason"))
            for t in d["trace"]] == [
        (0, "user", "Hello", None, None, None), (0, "assistant", "The answer is 42.", "Think about it.", 0, "forced"),
        (1, "user", "Hello there", None, None, None),
        (1, "assistant", "The answer is 42.", "Think about it.", 0, "forced")]
    assert [(h["role"], h["turn"], h["content"], h["reasoning"], h["tool_calls"], h["tool_call_id"])
            for h in d["history"]] == [
        ("user", 0, "Hello", "", [], ""), ("assistant", 0, "The answer is 42.", "Think about it.", [], ""),
        ("user", 1, "Hello there", "", [], ""), ("assistant", 1, "The answer is 42.", "Think about it.", [], "")]
    assert d["pending_tool_calls"] == []
    assert [(t["turn"], t["closed"], t["cache_state"], t["fork_tokens"]) for t in d["turns"]] == [
        (0, True, "none", 21), (1, True, "generated_branch", 38)]
    assert d["turns"][0]["steps"] == [a] and d["turns"][1]["steps"] == [a2]
    assert d["turns"][1]["totals"] == {"prompt_tokens": 26, "cached_input_tokens": 21, "uncached_prefill_tokens": 5,
                                       "recomputed_history_tokens": 0, "output_tokens": 12, "host_loaded_tokens": 0,
                                       "attention_work": a2["attention_work"],
                                       "uncached": {"new_input": 5}}
    assert a2["uncached"] == [{"reason": "new_input", "tokens": 5}]

    withids = client.get(f"/v1/conversations/{cid}", params={"tokens": 1}).json()
    forced = tpl.forced_ids(FORCED["reasoning"], FORCED["content"])
    expected = ([tpl.bos, *enc(system), tpl.user, *enc("Hello"), tpl.assistant, tpl.think, *forced,
                 tpl.user, *enc("Hello there"), tpl.assistant, tpl.think, *forced])
    assert withids["chain"]["token_ids"] == expected and len(expected) == 38  # keep: the tree holds the sequence
    assert withids["chain"]["sequence_token_ids"] == expected
    assert {k: v for k, v in withids["chain"].items() if not k.endswith("token_ids")} == d["chain"]
    assert client.get(f"/v1/conversations/{cid}", params={"tokens": 0}).json() == d


def test_policy_and_materialize_fields_take_effect(client, rt):
    """drop strips a closed turn's reasoning from the history, keep does not;
    materialize=never/always is recorded at the turn's close."""
    out = {}
    for policy, mode in (("keep", "auto"), ("drop", "never"), ("drop", "always")):
        cid = create(client, system=f"Policy {policy} {mode}.", policy=policy, materialize=mode)
        step_ok(msg(client, cid, content="Hello", forced=FORCED))
        out[(policy, mode)] = client.get(f"/v1/conversations/{cid}").json()
    keep, never, always = out[("keep", "auto")], out[("drop", "never")], out[("drop", "always")]
    assert keep["history"][1]["reasoning"] == "Think about it."
    assert never["history"][1]["reasoning"] == always["history"][1]["reasoning"] == ""
    assert never["trace"][1]["reasoning"] == "Think about it."  # the trace keeps what was generated
    n = first_prompt_len(rt, "Policy drop never.", "Hello")
    assert never["turns"][0]["fork_tokens"] == n - 1  # <think> vs </think>
    assert (never["chain"]["kind"], always["chain"]["kind"], keep["chain"]["kind"]) == ("prefix", "prefix", "generated")
    assert never["turns"][0]["materialize"] == "skipped: materialize=never"
    assert always["turns"][0]["materialize"] == "scheduled: materialize=always"
    assert keep["turns"][0]["materialize"] is None
    # drop holds the fork exactly (its partial page copied into a private page);
    # keep holds the whole generated sequence (prompt + 12 forced), exactly too.
    assert never["chain"]["cached_tokens"] == n - 1 == 8
    assert keep["chain"]["cached_tokens"] == n + 12 == 21


def test_tenant_salts_the_cache(client, rt):
    system = "Tenant check: " + "beta " * 20
    n = first_prompt_len(rt, system, "Hello")
    assert n == 30
    a = step_ok(msg(client, create(client, system=system, tenant="acme"), content="Hello", forced={"content": "x"}))
    b = step_ok(msg(client, create(client, system=system, tenant="acme"), content="Hello", forced={"content": "x"}))
    c = step_ok(msg(client, create(client, system=system, tenant="other"), content="Hello", forced={"content": "x"}))
    assert a["accounting"]["cached_input_tokens"] == 0
    assert b["accounting"]["cached_input_tokens"] == 16  # acme's first page, shared
    assert c["accounting"]["cached_input_tokens"] == 0  # never another tenant's


def test_delete(client, rt):
    cid = create(client, system="Delete over HTTP.", policy="keep")
    step_ok(msg(client, cid, content="Hello", forced=FORCED))
    # 21 computed: one locked tree page plus 5 tokens on the chain's private page.
    assert client.get("/debug/tree").json()["chains"][cid] == 21
    locked, private = rt.engine.tree.protected_size(), rt.engine.tree.private_tokens()
    r = client.delete(f"/v1/conversations/{cid}")
    assert r.status_code == 200 and r.json() == {"id": cid, "deleted": True}
    assert rt.engine.tree.protected_size() == locked - 16
    assert rt.engine.tree.private_tokens() == private - PAGE  # the private page is freed
    assert cid not in client.get("/debug/tree").json()["chains"]
    error_of(client.get(f"/v1/conversations/{cid}"), 404, "not_found")
    error_of(client.delete(f"/v1/conversations/{cid}"), 404, "not_found")
    error_of(msg(client, cid, content="Hi"), 404, "not_found")


# ----- tool calls, logprobs -----------------------------------------------------


def test_tool_call_round_trip(client, rt):
    cid = create(client, system="Tool round trip.", policy="keep")
    f0 = {"reasoning": "I need two tools.", "content": "Let me check.", "tool_calls": [WEATHER, TIME]}
    s0 = step_ok(msg(client, cid, content="Weather and time?", forced=f0))
    calls = [{"id": "call_0_0_0", **WEATHER}, {"id": "call_0_0_1", **TIME}]
    assert (s0["turn"], s0["step"], s0["finish_reason"]) == (0, 0, "tool_calls")
    assert (s0["reasoning"], s0["content"], s0["tool_calls"]) == ("I need two tools.", "Let me check.", calls)
    n0 = first_prompt_len(rt, "Tool round trip.", "Weather and time?")
    out0 = forced_len(rt, f0)
    assert (s0["accounting"]["prompt_tokens"], s0["accounting"]["output_tokens"]) == (n0, out0)
    d = client.get(f"/v1/conversations/{cid}").json()
    assert d["pending_tool_calls"] == calls
    assert [(t["turn"], t["closed"]) for t in d["turns"]] == [(0, False)]
    seq0 = d["chain"]["sequence_tokens"]
    assert seq0 == n0 + out0

    s1 = step_ok(results(client, cid, results=[{"tool_call_id": "call_0_0_1", "content": "12:00"},
                                               {"tool_call_id": "call_0_0_0", "content": "sunny"}],
                         forced={"content": "Sunny, noon."}))
    assert (s1["turn"], s1["step"], s1["finish_reason"], s1["content"], s1["tool_calls"]) == (
        0, 1, "forced", "Sunny, noon.", [])
    a = s1["accounting"]
    # Results render in the order of the pending calls, not of the request.
    assert a["prompt_tokens"] == seq0 + results_len(rt, ["sunny", "12:00"])
    # The tool step continues the chain exactly (its private partial page too).
    assert a["cached_input_tokens"] == seq0
    assert (a["alignment_loss_tokens"], a["recomputed_history_tokens"]) == (0, 0)
    assert a["uncached_prefill_tokens"] == a["prompt_tokens"] - a["cached_input_tokens"]
    assert a["cache_state"] is None and a["counterfactual"] is None  # only a turn's first step has them

    d = client.get(f"/v1/conversations/{cid}").json()
    assert d["pending_tool_calls"] == []
    assert [(t["role"], t.get("tool_call_id"), t["content"]) for t in d["trace"]] == [
        ("user", None, "Weather and time?"), ("assistant", None, "Let me check."),
        ("tool", "call_0_0_0", "sunny"), ("tool", "call_0_0_1", "12:00"), ("assistant", None, "Sunny, noon.")]
    # The trace keeps the engine's finish reason (how the output was produced); the
    # step's response said "tool_calls".
    assert [(t["step"], t["finish_reason"]) for t in d["trace"] if t["role"] == "assistant"] == [
        (0, "forced"), (1, "forced")]
    assert [(t["turn"], t["closed"], len(t["steps"])) for t in d["turns"]] == [(0, True, 2)]
    assert d["turns"][0]["steps"][1] == a
    assert d["turns"][0]["totals"]["output_tokens"] == out0 + forced_len(rt, {"content": "Sunny, noon."})

    # The next turn starts normally.
    s2 = step_ok(msg(client, cid, content="Thanks", forced={"content": "Welcome."}))
    assert (s2["turn"], s2["step"]) == (1, 0)


def test_logprobs(client, rt):
    cid = create(client, system="Logprobs over HTTP.", policy="keep")
    s = step_ok(msg(client, cid, content="Hello", max_tokens=5, logprobs=True))
    assert s["accounting"]["output_tokens"] == 5 and s["finish_reason"] == "length"
    assert len(s["logprobs"]) == 5 and all(isinstance(x, float) and x <= 0.0 for x in s["logprobs"])
    assert step_ok(msg(client, cid, content="Again", max_tokens=2))["logprobs"] is None
    f = step_ok(msg(client, cid, content="Replay", forced=FORCED, logprobs=True))
    assert len(f["logprobs"]) == 12 and all(x <= 0.0 for x in f["logprobs"])


def test_seeded_sampling_over_http_is_reproducible(client, rt):
    outs = []
    for seed in (7, 7):
        cid = create(client, system="Seeded sampling over HTTP.", tenant=f"t{len(outs)}")
        s = step_ok(msg(client, cid, content="Hello", max_tokens=6, temperature=1.0, seed=seed))
        outs.append((s["reasoning"], s["content"], s["accounting"]["output_tokens"]))
    assert outs[0] == outs[1] and outs[0][2] <= 6


# ----- /debug/tree and /metrics --------------------------------------------------------


def test_debug_tree(client, rt):
    cid = create(client, system="Debug tree over HTTP.", policy="keep")
    step_ok(msg(client, cid, content="Hello", forced={"reasoning": "r " * 20, "content": "c " * 20}))
    chain = client.get(f"/v1/conversations/{cid}").json()["chain"]
    cached = chain["cached_tokens"]
    # keep holds the exact sequence: 3 tree pages plus a private partial page,
    # which /debug/tree counts in "chains" but lists as no node.
    assert cached == chain["sequence_tokens"] == 54 and cached % PAGE == 6
    full = client.get("/debug/tree").json()
    assert full["page_size"] == PAGE
    assert full["chains"][cid] == cached
    assert set(full["chains"]) == set(rt.conversations)
    keys = {"id", "parent", "tokens", "depth_tokens", "preview", "hit_count", "lock_count", "last_access_age_s",
            "residency", "owners", "namespace", "cache_salt"}
    assert all(set(n) == keys for n in full["nodes"])
    mine = client.get("/debug/tree", params={"conversation": cid}).json()
    assert mine["page_size"] == PAGE and mine["chains"] == full["chains"]
    assert mine["nodes"] and all(cid in n["owners"] for n in mine["nodes"])
    assert sum(n["tokens"] for n in mine["nodes"]) == cached // PAGE * PAGE
    assert max(n["depth_tokens"] for n in mine["nodes"]) == cached // PAGE * PAGE
    assert {n["id"] for n in mine["nodes"]} <= {n["id"] for n in full["nodes"]}
    assert all(n["namespace"] == "tiny|" + rt.tokenizer.digest + "|deepseek" for n in mine["nodes"])
    assert mine["nodes"][0]["preview"].startswith("<｜begin▁of▁sentence｜>Debug tree over HTTP.")
    error_of(client.get("/debug/tree", params={"conversation": "no-such-conversation"}), 404, "not_found")


def test_metrics_move_by_exact_amounts(client, rt):
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    for name in ("steps_total", "prompt_tokens_total", "cached_input_tokens_total", "prefill_tokens_total",
                 "recomputed_history_tokens_total", "output_tokens_total", "step_errors_total",
                 "materialized_total", "offload_demoted_bytes_total", "offload_demote_seconds_total"):
        assert f"# TYPE session_runtime_{name} counter\n" in r.text
    for name in ("pool_capacity_tokens", "pool_free_tokens", "tree_locked_tokens", "tree_evictable_tokens",
                 "conversations", "backend_up"):
        assert f"# TYPE session_runtime_{name} gauge\n" in r.text
    for name in ("step_latency_seconds", "time_to_first_token_seconds"):
        assert f"# TYPE session_runtime_{name} histogram\n" in r.text

    m0 = metrics(client)
    cid = create(client, system="Metrics move by exact amounts.", policy="keep")
    a1 = step_ok(msg(client, cid, content="Hello", forced=FORCED))["accounting"]
    a2 = step_ok(msg(client, cid, content="Hello again", forced=FORCED))["accounting"]
    _, events = stream(client, f"/v1/conversations/{cid}/messages", {"content": "Streamed", "forced": FORCED})
    a3 = events[-2]["accounting"]
    error_of(msg(client, "no-such-conversation", content="Hi"), 404)
    error_of(msg(client, cid, content="word " * 600), 413)
    m1 = metrics(client)
    steps = (a1, a2, a3)

    def delta(name):
        return m1[f"session_runtime_{name}"] - m0[f"session_runtime_{name}"]

    assert delta("steps_total") == 3
    assert delta("prompt_tokens_total") == sum(a["prompt_tokens"] for a in steps)
    assert delta("cached_input_tokens_total") == sum(a["cached_input_tokens"] for a in steps) > 0
    assert delta("prefill_tokens_total") == sum(a["uncached_prefill_tokens"] for a in steps)
    assert delta("recomputed_history_tokens_total") == sum(a["recomputed_history_tokens"] for a in steps)
    assert delta("output_tokens_total") == 36
    assert delta("step_errors_total") == 2
    ttft_s = sum(a["ttft_ms"] for a in steps) / 1e3
    assert delta("time_to_first_token_seconds_sum") == pytest.approx(ttft_s, abs=2e-6)
    assert delta("time_to_first_token_seconds_count") == delta("step_latency_seconds_count") == 3
    assert delta("step_latency_seconds_sum") > 0
    free, locked, evictable = pool_state(rt)
    assert (m1["session_runtime_pool_capacity_tokens"], m1["session_runtime_pool_free_tokens"]) == (16384, free)
    assert (m1["session_runtime_tree_locked_tokens"], m1["session_runtime_tree_evictable_tokens"]) == (locked, evictable)
    assert m1["session_runtime_conversations"] == len(rt.conversations)
    assert delta("conversations") == 1


# ----- errors ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def closed_conv(live, client):
    """A conversation with one closed turn; no test here may change it."""
    cid = create(client, system="Errors change nothing (closed).", policy="keep")
    step_ok(msg(client, cid, content="First", forced=FORCED))
    return cid


@pytest.fixture(scope="module")
def pending_conv(live, client):
    """A conversation waiting for call_0_0_0; no test here may change it."""
    cid = create(client, system="Errors change nothing (pending).", policy="keep")
    step_ok(msg(client, cid, content="Weather?", forced={"content": "Checking.", "tool_calls": [WEATHER]}))
    return cid


def test_unknown_conversation_is_404(client, rt):
    before = pool_state(rt)
    for r in (
        client.get("/v1/conversations/nope"),
        client.get("/v1/conversations/nope", params={"tokens": 1}),
        client.delete("/v1/conversations/nope"),
        msg(client, "nope", content="Hi"),
        msg(client, "nope", content="Hi", stream=True),
        results(client, "nope", results=[{"tool_call_id": "call_0_0_0"}]),
        client.get("/debug/tree", params={"conversation": "nope"}),
    ):
        assert error_of(r, 404, "not_found") == "conversation 'nope' not found"
    assert pool_state(rt) == before


MESSAGE_422 = [
    ({}, "body.content: Field required"),
    ({"content": 123}, "body.content: Input should be a valid string"),
    ({"content": ""}, "body.content: String should have at least 1 character"),
    ({"content": "x", "max_tokens": "many"}, "body.max_tokens: Input should be a valid integer"),
    ({"content": "x", "max_tokens": -1}, "body.max_tokens: Input should be greater than or equal to 0"),
    ({"content": "x", "temperature": -0.5}, "body.temperature: Input should be greater than or equal to 0"),
    ({"content": "x", "logprobs": "maybe"}, "body.logprobs: Input should be a valid boolean"),
    ({"content": "x", "bogus": 1}, "body.bogus: Extra inputs are not permitted"),
    ({"content": "x", "forced": "text"}, "body.forced: Input should be a valid dictionary"),
    ({"content": "x", "forced": {"answer": "no"}}, "body.forced.answer: Extra inputs are not permitted"),
    ({"content": "x", "forced": {"tool_calls": [{"arguments": {}}]}}, "body.forced.tool_calls.0.name: Field required"),
    ({"content": "x", "forced": {"tool_calls": [{"name": "f", "arguments": [1]}]}},
     "body.forced.tool_calls.0.arguments: Input should be a valid dictionary"),
    ([], "body: Input should be a valid dictionary"),
]
RESULTS_422 = [
    ({}, "body.results: Field required"),
    ({"results": []}, "body.results: List should have at least 1 item"),
    ({"results": [{"content": "x"}]}, "body.results.0.tool_call_id: Field required"),
    ({"results": [{"tool_call_id": 5}]}, "body.results.0.tool_call_id: Input should be a valid string"),
    ({"results": [{"tool_call_id": "call_0_0_0", "extra": 1}]}, "body.results.0.extra: Extra inputs are not permitted"),
    ({"results": [{"tool_call_id": "call_0_0_0"}], "max_tokens": -3},
     "body.max_tokens: Input should be greater than or equal to 0"),
]
CREATE_422 = [
    ({"policy": "bogus"}, "body.policy: Input should be"),
    ({"keep_last_k": -1}, "body.keep_last_k: Input should be greater than or equal to 0"),
    ({"materialize": "sometimes"}, "body.materialize: Input should be 'auto', 'always' or 'never'"),
    ({"template": "chatml"}, "body.template: Input should be 'deepseek', 'qwen3' or 'hf'"),
    ({"continue_probability": 1.5}, "body.continue_probability: Input should be less than or equal to 1"),
    ({"tools": "get_weather"}, "body.tools: Input should be a valid list"),
    ({"system": ["a"]}, "body.system: Input should be a valid string"),
    ({"conversation_id": "mine"}, "body.conversation_id: Extra inputs are not permitted"),
    ({"offload": "sometimes"}, "body.offload: Input should be 'never', 'always', 'ttl'"),
    ({"ttl_s": -1}, "body.ttl_s: Input should be greater than or equal to 0"),
]


@pytest.mark.parametrize("body,expected", MESSAGE_422, ids=[m for _, m in MESSAGE_422])
def test_malformed_message_is_422(client, rt, closed_conv, body, expected):
    before = snapshot(client, closed_conv)
    assert error_of(msg(client, closed_conv, **body) if isinstance(body, dict) else
                    client.post(f"/v1/conversations/{closed_conv}/messages", json=body),
                    422, "validation_error").startswith(expected)
    assert snapshot(client, closed_conv) == before


@pytest.mark.parametrize("body,expected", RESULTS_422, ids=[m for _, m in RESULTS_422])
def test_malformed_tool_results_is_422(client, rt, pending_conv, body, expected):
    before = snapshot(client, pending_conv)
    assert error_of(results(client, pending_conv, **body), 422, "validation_error").startswith(expected)
    assert snapshot(client, pending_conv) == before


@pytest.mark.parametrize("body,expected", CREATE_422, ids=[m for _, m in CREATE_422])
def test_malformed_create_is_422(client, rt, body, expected):
    n = len(rt.conversations)
    assert error_of(client.post("/v1/conversations", json=body), 422, "validation_error").startswith(expected)
    assert len(rt.conversations) == n


def test_not_json_is_422(client, rt, closed_conv):
    before = snapshot(client, closed_conv)
    for raw in (b"not json", b'{"content": "x",', b""):
        r = client.post(f"/v1/conversations/{closed_conv}/messages", content=raw,
                        headers={"content-type": "application/json"})
        message = error_of(r, 422, "validation_error")
        assert message.startswith("body") and ("JSON decode error" in message or "Field required" in message)
    assert snapshot(client, closed_conv) == before


def test_several_validation_errors_are_listed(client, closed_conv):
    message = error_of(msg(client, closed_conv, max_tokens=-1, bogus=True), 422, "validation_error")
    assert "body.content: Field required" in message
    assert "body.max_tokens: Input should be greater than or equal to 0" in message
    assert "body.bogus: Extra inputs are not permitted" in message


def test_tool_call_conflicts_are_409(client, rt):
    cid = create(client, system="Tool call conflicts over HTTP.", policy="keep")
    step_ok(msg(client, cid, content="Two calls", forced={"content": "Checking.", "tool_calls": [WEATHER, TIME]}))
    before = snapshot(client, cid)
    pools = pool_state(rt)

    def unchanged():
        assert snapshot(client, cid) == before and pool_state(rt) == pools
        rt.check_integrity()

    both = [{"tool_call_id": "call_0_0_0", "content": "sunny"}, {"tool_call_id": "call_0_0_1", "content": "noon"}]
    m = error_of(results(client, cid, results=[*both, {"tool_call_id": "call_9_9_9"}]), 409, "conflict")
    assert m == "unknown or already answered tool calls: ['call_9_9_9']"
    unchanged()
    m = error_of(results(client, cid, results=[*both, both[0]]), 409, "conflict")
    assert m == "unknown or already answered tool calls: ['call_0_0_0']"
    unchanged()
    m = error_of(msg(client, cid, content="Are you there?"), 409, "conflict")
    assert m == "turn 0 waits for tool results: ['call_0_0_0', 'call_0_0_1']; answer them first"
    unchanged()
    # Answering only some of the calls is bad input (InvalidRequest), not a conflict.
    m = error_of(results(client, cid, results=both[:1]), InvalidRequest.status, "invalid_request")
    assert m == "results must answer every pending call; missing ['call_0_0_1']"
    unchanged()
    error_of(results(client, cid, results=[{"tool_call_id": "call_0_0_0", "content": "word " * 600},
                                           both[1]]), 413, "context_too_long")
    unchanged()

    # Answer both; the next step calls another tool: the old ids are answered now.
    s = step_ok(results(client, cid, results=both, forced={"content": "One more.", "tool_calls": [WEATHER]}))
    assert [c["id"] for c in s["tool_calls"]] == ["call_0_1_0"]
    before = snapshot(client, cid)
    pools = pool_state(rt)
    m = error_of(results(client, cid, results=[both[0]]), 409, "conflict")
    assert m == "unknown or already answered tool calls: ['call_0_0_0']"
    unchanged()
    step_ok(results(client, cid, results=[{"tool_call_id": "call_0_1_0", "content": "still sunny"}],
                    forced={"content": "Done."}))
    before = snapshot(client, cid)
    pools = pool_state(rt)
    assert before[0]["pending_tool_calls"] == []
    m = error_of(results(client, cid, results=[{"tool_call_id": "call_0_1_0"}]), 409, "conflict")
    assert m == "no tool call is pending in this conversation"
    unchanged()


def test_oversized_prompt_is_413(client, rt, closed_conv):
    before = snapshot(client, closed_conv)
    pools = pool_state(rt)
    long_msg = "word " * 505  # fits the context alone, not after the history
    m = error_of(msg(client, closed_conv, content=long_msg), 413, "context_too_long")
    prompt = before[0]["chain"]["sequence_tokens"] + len(rt.tokenizer.encode(long_msg)) + 3
    assert m == f"prompt of {prompt} tokens (plus 0 forced) does not fit the context limit of {MAX_CONTEXT}"
    # A message that alone has more tokens than the context is refused before it is tokenized whole.
    m = error_of(msg(client, closed_conv, content="word " * 600), 413, "context_too_long")
    assert m == f"content of 3000 bytes has more tokens than the context of {MAX_CONTEXT}; it was not tokenized whole"
    # Forced output past the context is the same error.
    m = error_of(msg(client, closed_conv, content="Hi", forced={"content": long_msg}), 413, "context_too_long")
    assert "does not fit the context limit of 512" in m
    # A prompt of exactly the limit does not fit (the last position is for output).
    fill = MAX_CONTEXT - before[0]["chain"]["sequence_tokens"] - 3
    words = "a" + " a" * (fill - 1)
    assert len(rt.tokenizer.encode(words)) == fill
    m = error_of(msg(client, closed_conv, content=words, max_tokens=1), 413, "context_too_long")
    assert m == f"prompt of {MAX_CONTEXT} tokens (plus 0 forced) does not fit the context limit of {MAX_CONTEXT}"
    assert snapshot(client, closed_conv) == before and pool_state(rt) == pools


@pytest.fixture(scope="module")
def small_pool():
    """Pool of 96 tokens (6 pages), context 512: a prompt can exhaust the pool."""
    with served(pool_tokens=96) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        yield s.runtime, c
        s.runtime.check_integrity()


def test_pool_exhausted_is_507(small_pool):
    rt, client = small_pool
    # The holder's pages are locked by a tool wait that never offloads: an idle
    # chain (a closed turn) would give way under pressure and the requests below
    # would succeed (see the end of this test).
    holder = create(client, system="Pool holder.", policy="keep", offload="never")
    a = step_ok(msg(client, holder, content="Hello", forced={"tool_calls": [WEATHER]}))["accounting"]
    seq = a["prompt_tokens"] + a["output_tokens"]
    assert seq == first_prompt_len(rt, "Pool holder.", "Hello") + forced_len(rt, {"tool_calls": [WEATHER]}) == 54
    # 3 tree pages (48) plus the chain's private partial page (6 tokens, a whole page).
    assert client.get("/debug/tree").json()["chains"][holder] == 54
    before = snapshot(client, holder)
    pools = pool_state(rt)
    assert pools == (32, 48, 0) and rt.engine.tree.private_tokens() == PAGE
    m0 = metrics(client)

    # The next prompt needs 3 new pages on top of the 4 held (the private one
    # continues): only 2 are free.
    content = "word " * 40
    prompt = seq + results_len(rt, [content])
    need = -(-(prompt - 64) // PAGE) * PAGE
    assert need == 48
    m = error_of(results(client, holder, results=[{"tool_call_id": "call_0_0_0", "content": content}],
                         max_tokens=2), 507, "pool_exhausted")
    assert m == ("need 48 KV slots, 32 free after evicting every unlocked leaf "
                 "(48 tokens are locked by conversations)")
    assert snapshot(client, holder) == before and pool_state(rt) == pools
    assert client.get(f"/v1/conversations/{holder}").json()["pending_tool_calls"] == [{"id": "call_0_0_0", **WEATHER}]
    rt.check_integrity()

    # Another conversation cannot take the locked pages either, and is left empty.
    other = create(client, system="Pool other.")
    empty = snapshot(client, other)
    error_of(msg(client, other, content=content, max_tokens=2), 507, "pool_exhausted")
    r, _ = stream(client, f"/v1/conversations/{other}/messages", {"content": content, "max_tokens": 2})
    error_of(r, 507, "pool_exhausted")  # before its first token: the status, as a plain request
    assert snapshot(client, other) == empty and pool_state(rt) == pools
    assert metrics(client)["session_runtime_pool_free_tokens"] == 32
    # Three failed steps, the streamed one included.
    assert metrics(client)["session_runtime_step_errors_total"] - m0["session_runtime_step_errors_total"] == 3
    rt.check_integrity()

    # Once the holder's turn closes its chain is idle: under pressure it leaves
    # the device first (demoted to the host tier), so the same request fits.
    step_ok(results(client, holder, results=[{"tool_call_id": "call_0_0_0", "content": "sunny"}],
                    forced={"content": "ok"}))
    held = client.get("/debug/tree").json()["chains"][holder]
    assert held == seq + results_len(rt, ["sunny"]) + forced_len(rt, {"content": "ok"})
    step_ok(msg(client, other, content=content, max_tokens=2))
    d = client.get(f"/v1/conversations/{holder}").json()
    assert d["chain"]["kv_host_bytes"] == held * TINY_BYTES_PER_TOKEN
    rt.check_integrity()


@pytest.mark.parametrize("case", ["whitespace content", "unanswered pending call", "template unfit for tokenizer"])
def test_bad_input_that_passes_the_schema_is_422(client, closed_conv, case):
    if case == "whitespace content":
        r = msg(client, closed_conv, content="   \n")
    elif case == "unanswered pending call":
        cid = create(client, system="Unanswered pending call.", policy="keep")
        step_ok(msg(client, cid, content="Two calls", forced={"tool_calls": [WEATHER, TIME]}))
        r = results(client, cid, results=[{"tool_call_id": "call_0_0_0"}])
    else:
        r = client.post("/v1/conversations", json={"template": "qwen3"})
    error_of(r, 422)


# ----- streaming ---------------------------------------------------------------------


def deltas(events, kind) -> str:
    return "".join(e["delta"] for e in events if isinstance(e, dict) and e["type"] == kind)


def check_stream_shape(events) -> dict:
    """reasoning deltas, then content deltas, then one `step` event, then [DONE]."""
    assert events[-1] == "[DONE]" and events[-2]["type"] == "step"
    kinds = [e["type"] for e in events[:-2]]
    assert set(kinds) <= {"reasoning", "content"}
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning"), "a reasoning delta after content"
    return events[-2]


def test_stream_message_with_forced_output(client, rt):
    cid = create(client, system="Streamed forced turn.", policy="keep", tenant="stream-forced")
    f = {"reasoning": "Let me think step by step about this.", "content": "The answer is forty-two, clearly."}
    r, events = stream(client, f"/v1/conversations/{cid}/messages", {"content": "Hello", "forced": f})
    step = check_stream_shape(events)
    assert sum(e["type"] == "reasoning" for e in events[:-2]) > 1 and sum(e["type"] == "content" for e in events[:-2]) > 1
    assert deltas(events, "reasoning") == step["reasoning"] == f["reasoning"]
    assert deltas(events, "content") == step["content"] == f["content"]
    assert (step["conversation_id"], step["turn"], step["step"], step["finish_reason"]) == (cid, 0, 0, "forced")
    a = step["accounting"]
    n = first_prompt_len(rt, "Streamed forced turn.", "Hello")
    assert (a["prompt_tokens"], a["cached_input_tokens"], a["output_tokens"]) == (n, 0, forced_len(rt, f))
    d = client.get(f"/v1/conversations/{cid}").json()
    assert d["turns"][0]["steps"] == [a] and d["turns"][0]["closed"]
    assert [(t["role"], t["content"]) for t in d["trace"]] == [("user", "Hello"), ("assistant", f["content"])]

    # The same request, not streamed, on a twin conversation: the same step.
    twin = create(client, system="Streamed forced turn.", policy="keep", tenant="stream-forced-twin")
    plain = step_ok(msg(client, twin, content="Hello", forced=f))
    assert {k: plain[k] for k in ("reasoning", "content", "tool_calls", "finish_reason")} == {
        k: step[k] for k in ("reasoning", "content", "tool_calls", "finish_reason")}
    assert plain["accounting"]["prompt_tokens"] == a["prompt_tokens"]


def test_stream_greedy_equals_non_streamed(client, rt):
    system = "Streamed greedy decode."
    s = create(client, system=system, tenant="greedy-stream")
    p = create(client, system=system, tenant="greedy-plain")
    _, events = stream(client, f"/v1/conversations/{s}/messages", {"content": "Tell me", "max_tokens": 12})
    step = check_stream_shape(events)
    plain = step_ok(msg(client, p, content="Tell me", max_tokens=12))
    assert deltas(events, "reasoning") == step["reasoning"] == plain["reasoning"]
    assert deltas(events, "content") == step["content"] == plain["content"]
    assert step["accounting"]["output_tokens"] == plain["accounting"]["output_tokens"]
    assert step["finish_reason"] == plain["finish_reason"]


def test_stream_tool_results(client, rt):
    cid = create(client, system="Streamed tool results.", policy="keep")
    step_ok(msg(client, cid, content="Weather?", forced={"reasoning": "Use the tool.", "tool_calls": [WEATHER]}))
    seq = client.get(f"/v1/conversations/{cid}").json()["chain"]["sequence_tokens"]
    f = {"reasoning": "The tool says sunny.", "content": "It is sunny in Paris."}
    _, events = stream(client, f"/v1/conversations/{cid}/tool_results",
                       {"results": [{"tool_call_id": "call_0_0_0", "content": "sunny"}], "forced": f})
    step = check_stream_shape(events)
    assert deltas(events, "reasoning") == step["reasoning"] == f["reasoning"]
    assert deltas(events, "content") == step["content"] == f["content"]
    assert (step["turn"], step["step"], step["finish_reason"]) == (0, 1, "forced")
    a = step["accounting"]
    assert a["prompt_tokens"] == seq + results_len(rt, ["sunny"])
    assert a["cached_input_tokens"] == seq  # the exact continuation, private page included
    d = client.get(f"/v1/conversations/{cid}").json()
    assert d["pending_tool_calls"] == [] and d["turns"][0]["closed"] and d["turns"][0]["steps"][1] == a


def test_stream_that_ends_in_tool_calls(client, rt):
    cid = create(client, system="Streamed tool call.", policy="keep")
    _, events = stream(client, f"/v1/conversations/{cid}/messages",
                       {"content": "Weather?", "forced": {"content": "Checking.", "tool_calls": [WEATHER]}})
    step = check_stream_shape(events)
    assert step["finish_reason"] == "tool_calls" and step["tool_calls"] == [{"id": "call_0_0_0", **WEATHER}]
    assert deltas(events, "content").startswith("Checking.")
    assert client.get(f"/v1/conversations/{cid}").json()["pending_tool_calls"] == [{"id": "call_0_0_0", **WEATHER}]


def test_stream_errors(client, rt, pending_conv, closed_conv):
    """A streamed step that fails before its first token answers with the
    error's status, as a plain one does (nothing has been sent yet), and
    changes nothing."""
    r, events = stream(client, "/v1/conversations/nope/messages", {"content": "Hi"})
    error_of(r, 404, "not_found")
    for cid, path, body, status, kind in (
        (pending_conv, "messages", {"content": "Still there?"}, 409, "conflict"),
        (pending_conv, "tool_results", {"results": [{"tool_call_id": "call_7_7_7"}]}, 409, "conflict"),
        (closed_conv, "tool_results", {"results": [{"tool_call_id": "call_0_0_0"}]}, 409, "conflict"),
        (closed_conv, "messages", {"content": "word " * 600}, 413, "context_too_long"),
    ):
        before = snapshot(client, cid)
        r, events = stream(client, f"/v1/conversations/{cid}/{path}", body)
        error_of(r, status, kind)
        assert events == [] and snapshot(client, cid) == before
        rt.check_integrity()
    # Validation runs before the stream: a plain 422.
    error_of(client.post(f"/v1/conversations/{closed_conv}/messages", json={"stream": True}), 422, "validation_error")


def test_a_failed_streamed_step_is_counted_like_a_plain_one(client, pending_conv):
    m0 = metrics(client)["session_runtime_step_errors_total"]
    error_of(msg(client, pending_conv, content="Still there?"), 409)
    m1 = metrics(client)["session_runtime_step_errors_total"]
    stream(client, f"/v1/conversations/{pending_conv}/messages", {"content": "Still there?"})
    m2 = metrics(client)["session_runtime_step_errors_total"]
    assert (m1 - m0, m2 - m1) == (1, 1)


def test_client_disconnect_after_a_forced_step_computed_leaves_a_complete_turn(client, rt, live, monkeypatch):
    """A forced output is computed in one forward, before its tokens stream: a
    client that leaves while they stream finds the turn complete. The step is
    held after its first token until the client has gone, deterministically."""
    system = "Disconnect mid-stream."
    cid = create(client, system=system, policy="keep", tenant="disconnect")
    f = {"reasoning": "A long thought " * 8, "content": "and a long answer " * 8}
    first_token, client_gone = threading.Event(), threading.Event()
    real = rt.send_message

    def send_message(conversation_id, content, *, on_token=None, **kw):
        if conversation_id != cid or on_token is None:
            return real(conversation_id, content, on_token=on_token, **kw)
        count = [0]

        def tok(t):
            on_token(t)
            count[0] += 1
            if count[0] == 1:
                first_token.set()
                assert client_gone.wait(60)

        return real(conversation_id, content, on_token=tok, **kw)

    monkeypatch.setattr(rt, "send_message", send_message)
    with httpx.Client(base_url=live.url, timeout=60) as c2:
        with c2.stream("POST", f"/v1/conversations/{cid}/messages",
                       json={"content": "Hello", "forced": f, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first[len("data: "):]) == {"type": "reasoning", "delta": "A"}
            assert first_token.is_set()
            # Nothing is committed mid-step. (Not over HTTP: GET reads the tree under
            # the engine's lock, which the held step owns.)
            assert rt.get(cid).turns == [] and rt.get(cid).trace == []
    client_gone.set()  # both the response and the connection are closed now

    deadline = time.monotonic() + 60
    while not client.get(f"/v1/conversations/{cid}").json()["turns"]:
        assert time.monotonic() < deadline, "the abandoned step never committed"
        time.sleep(0.02)
    monkeypatch.undo()
    rt.check_integrity()
    d = client.get(f"/v1/conversations/{cid}").json()
    n = first_prompt_len(rt, system, "Hello")
    out = forced_len(rt, f)
    assert [(t["role"], t["content"], t.get("reasoning")) for t in d["trace"]] == [
        ("user", "Hello", None), ("assistant", f["content"], f["reasoning"])]
    assert d["turns"][0]["closed"] and len(d["turns"][0]["steps"]) == 1
    a = d["turns"][0]["steps"][0]
    assert (a["prompt_tokens"], a["cached_input_tokens"], a["output_tokens"]) == (n, 0, out)
    assert d["chain"]["sequence_tokens"] == n + out
    assert d["chain"]["cached_tokens"] == n + out  # keep: exact, partial last page private

    # The conversation goes on from the complete turn, reusing all of it.
    s = step_ok(msg(client, cid, content="Next", forced={"content": "ok"}))
    assert s["turn"] == 1
    assert s["accounting"]["prompt_tokens"] == n + out + len(rt.tokenizer.encode("Next")) + 3
    assert s["accounting"]["cached_input_tokens"] == n + out


def test_client_disconnect_during_a_greedy_decode_cancels_the_step(client, rt, live):
    """Without any hook: read one event of a long decode and close. The step
    stops at its next token and changes nothing: the conversation then steps
    exactly as a twin that never ran."""
    system = "Disconnect during greedy decode."
    cid = create(client, system=system, policy="keep", tenant="disc-greedy")
    with httpx.Client(base_url=live.url, timeout=60) as c2:
        with c2.stream("POST", f"/v1/conversations/{cid}/messages",
                       json={"content": "Go on", "max_tokens": 400, "stream": True}) as r:
            next(line for line in r.iter_lines() if line)
    deadline = time.monotonic() + 60
    while rt.engine.stepping:  # the cancelled step unwinds at its next token
        assert time.monotonic() < deadline, "the abandoned step never stopped"
        time.sleep(0.02)
    d = client.get(f"/v1/conversations/{cid}").json()
    assert d["turns"] == [] and d["trace"] == []
    twin = create(client, system=system, policy="keep", tenant="disc-greedy-twin")
    s = step_ok(msg(client, cid, content="Go on", max_tokens=8))
    plain = step_ok(msg(client, twin, content="Go on", max_tokens=8))
    assert s["turn"] == 0 and (s["reasoning"], s["content"]) == (plain["reasoning"], plain["content"])
    rt.check_integrity()


def test_client_disconnect_during_a_plain_request_cancels_the_step(client, rt, live):
    """Not streamed: the server watches the connection while the step runs."""
    system = "Disconnect during a plain request."
    cid = create(client, system=system, policy="keep", tenant="disc-plain")
    started = threading.Event()
    real = rt.send_message

    def send_message(conversation_id, content, **kw):
        if conversation_id == cid:
            started.set()
        return real(conversation_id, content, **kw)

    rt.send_message = send_message
    try:
        with httpx.Client(base_url=live.url, timeout=1.0) as c2:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
                c2.post(f"/v1/conversations/{cid}/messages", json={"content": "Go on", "max_tokens": 400})
        assert started.is_set()
        deadline = time.monotonic() + 60
        while rt.engine.stepping:
            assert time.monotonic() < deadline, "the abandoned step never stopped"
            time.sleep(0.02)
    finally:
        del rt.send_message
    assert client.get(f"/v1/conversations/{cid}").json()["turns"] == []
    rt.check_integrity()


# ----- concurrency -------------------------------------------------------------------


def in_thread(fn, out: list, name: str) -> threading.Thread:
    def run():
        try:
            out.append((name, fn()))
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out.append((name, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_two_requests_on_one_conversation_are_serialized(client, rt, live, monkeypatch):
    """The first request is held inside its step (it holds the conversation's
    lock); the second arrives meanwhile. Both succeed, as turns 0 and 1."""
    system = "Serialized on one conversation."
    cid = create(client, system=system, policy="keep", tenant="serialized")
    entered, release = threading.Event(), threading.Event()
    gets = []
    real_claim, real_get = rt.materializer.claim, rt.table.get

    def claim(owner):
        if owner == cid and not entered.is_set():
            entered.set()
            assert release.wait(60)
        return real_claim(owner)

    def get(conversation_id):
        if conversation_id == cid:
            gets.append(threading.current_thread().name)
        return real_get(conversation_id)

    monkeypatch.setattr(rt.materializer, "claim", claim)
    monkeypatch.setattr(rt.table, "get", get)  # the conversations' part: Runtime.get and its lock look it up there
    done = []
    with httpx.Client(base_url=live.url, timeout=60) as c1, httpx.Client(base_url=live.url, timeout=60) as c2:
        t1 = in_thread(lambda: msg(c1, cid, content="First", forced={"reasoning": "one", "content": "1"}), done, "first")
        assert entered.wait(60)
        n_gets = len(gets)
        t2 = in_thread(lambda: msg(c2, cid, content="Second", forced={"reasoning": "two", "content": "2"}), done,
                       "second")
        deadline = time.monotonic() + 60
        while len(gets) < n_gets + 2:  # respond() and table.locked() of the second request
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert done == []
        release.set()
        t1.join(60)
        t2.join(60)
    monkeypatch.undo()
    by_name = dict(done)
    first, second = step_ok(by_name["first"]), step_ok(by_name["second"])
    assert [name for name, _ in done] == ["first", "second"]
    assert (first["turn"], second["turn"]) == (0, 1)
    n = first_prompt_len(rt, system, "First")
    out = forced_len(rt, {"reasoning": "one", "content": "1"})
    assert second["accounting"]["prompt_tokens"] == n + out + len(rt.tokenizer.encode("Second")) + 3
    assert second["accounting"]["cached_input_tokens"] == n + out  # turn 0's chain, exactly
    d = client.get(f"/v1/conversations/{cid}").json()
    assert [(t["turn"], t["role"], t["content"]) for t in d["trace"]] == [
        (0, "user", "First"), (0, "assistant", "1"), (1, "user", "Second"), (1, "assistant", "2")]
    assert [t["turn"] for t in d["turns"]] == [0, 1] and all(t["closed"] for t in d["turns"])


def test_a_held_conversation_does_not_block_another(client, rt, live, monkeypatch):
    """Conversation A is held inside its step; a request on B completes first."""
    a = create(client, system="Held conversation A.", policy="keep")
    b = create(client, system="Free conversation B.", policy="keep")
    entered, release = threading.Event(), threading.Event()
    real_claim = rt.materializer.claim

    def claim(owner):
        if owner == a:
            entered.set()
            assert release.wait(60)
        return real_claim(owner)

    monkeypatch.setattr(rt.materializer, "claim", claim)
    done = []
    with httpx.Client(base_url=live.url, timeout=60) as ca, httpx.Client(base_url=live.url, timeout=60) as cb:
        ta = in_thread(lambda: msg(ca, a, content="Slow", forced={"content": "A"}), done, "A")
        assert entered.wait(60)
        tb = in_thread(lambda: msg(cb, b, content="Quick", forced={"content": "B"}), done, "B")
        tb.join(60)
        # B is done while A is still inside its step.
        assert [name for name, _ in done] == ["B"] and ta.is_alive()
        assert client.get(f"/v1/conversations/{b}").json()["turns"][0]["closed"]
        release.set()
        ta.join(60)
    monkeypatch.undo()
    assert [name for name, _ in done] == ["B", "A"]
    assert step_ok(dict(done)["A"])["content"] == "A" and step_ok(dict(done)["B"])["content"] == "B"
    assert [t["content"] for t in client.get(f"/v1/conversations/{a}").json()["trace"]] == ["Slow", "A"]


def test_long_decode_and_a_quick_request_both_complete(client, rt, live):
    """A long greedy decode streams on A; once its first token is out, a quick
    forced step on B runs. Both complete with consistent conversations."""
    a = create(client, system="Long decode on A.", policy="keep", tenant="long-a")
    b = create(client, system="Quick request on B.", policy="keep", tenant="quick-b")
    done = []
    with httpx.Client(base_url=live.url, timeout=120) as ca:
        with ca.stream("POST", f"/v1/conversations/{a}/messages",
                       json={"content": "Write a lot", "max_tokens": 80, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)
            tb = in_thread(lambda: msg(client, b, content="Quick", forced={"content": "done"}), done, "B")
            events = sse_events(lines)
        tb.join(120)
    step = check_stream_shape(events)
    quick = step_ok(dict(done)["B"])
    assert quick["turn"] == 0 and quick["content"] == "done"
    assert step["accounting"]["output_tokens"] == 80 or step["finish_reason"] == "stop"
    da, db = (client.get(f"/v1/conversations/{c}").json() for c in (a, b))
    assert da["turns"][0]["steps"][0] == step["accounting"] and db["turns"][0]["steps"][0] == quick["accounting"]
    assert [t["role"] for t in da["trace"]] == [t["role"] for t in db["trace"]] == ["user", "assistant"]


def test_concurrent_steps_on_many_conversations(client, rt, live):
    ids = [create(client, system=f"Many conversations {i}.", policy="keep") for i in range(6)]
    done = []
    threads = []
    for i, cid in enumerate(ids):
        def work(cid=cid, i=i):
            with httpx.Client(base_url=live.url, timeout=120) as c:
                return [step_ok(msg(c, cid, content=f"Turn {t}", forced={"content": f"{i}.{t}"})) for t in range(3)]
        threads.append(in_thread(work, done, cid))
    for t in threads:
        t.join(120)
    assert sorted(name for name, _ in done) == sorted(ids)
    for cid, steps in done:
        assert not isinstance(steps, Exception), steps
        assert [s["turn"] for s in steps] == [0, 1, 2]
        d = client.get(f"/v1/conversations/{cid}").json()
        assert [t["content"] for t in d["trace"] if t["role"] == "user"] == ["Turn 0", "Turn 1", "Turn 2"]
        assert [s["accounting"] for s in steps] == [t["steps"][0] for t in d["turns"]]


def test_token_ids_show_the_chain_the_tree_holds_after_a_drop(client, rt):
    """Under drop the chain holds the canonical history up to the fork once the
    turn closes; `?tokens=1` shows that, and the generated sequence apart."""
    cid = create(client, system="Tokens after a drop.", policy="drop", materialize="never")
    step_ok(msg(client, cid, content="Hello", forced={"reasoning": "Think about it.", "content": "42."}))
    d = client.get(f"/v1/conversations/{cid}", params={"tokens": 1}).json()
    chain, seq = d["chain"]["token_ids"], d["chain"]["sequence_token_ids"]
    assert len(chain) == d["chain"]["cached_tokens"] and len(seq) == d["chain"]["sequence_tokens"]
    assert len(chain) < len(seq) and seq[: len(chain)] == chain  # the fork: a prefix of both
    conv = rt.get(cid)
    tpl = rt.template(conv.template)
    canonical = tpl.render(conv.system, conv.tools, conv.history, conv.policy.kept_turns(conv.closed_turns), False).ids
    assert canonical[: len(chain)] == chain and canonical != seq
