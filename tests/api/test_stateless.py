"""Stateless clients become conversations (session inference): the official
SDKs' loops that send their whole history each time are served as steps of
one conversation, retries replay the last step, other histories start new
conversations and change no stored one, tenants never share one, and the
protocols' own reasoning controls set the turn's policy.

One server for the module: every test uses its own system prompt, so no two
tests' histories meet."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from session_runtime.api.settings import ApiSettings, load_credentials
from tests.api.conftest import served

HEADER = "x-session-runtime-conversation"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    settings = ApiSettings(credentials=load_credentials(None, str(keys), "admin-key"))
    with served(settings, served_model_names=("claude-sonnet-4-5", "tiny")) as s:
        yield s


@pytest.fixture
def rt(live):
    yield live.runtime
    live.runtime.check_integrity()


def system() -> str:
    return f"You are test {uuid.uuid4().hex[:8]}."


def chat(live, messages, key="key-a", **extra) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **extra},
                      headers={"authorization": f"Bearer {key}"} if key else {}, timeout=120)


def test_chat_loop_is_one_conversation(live, rt):
    sys_msg = {"role": "system", "content": system()}
    history = [sys_msg, {"role": "user", "content": "Hello there"}]
    ids = []
    for turn in range(3):
        r = chat(live, history)
        assert r.status_code == 200, r.text
        body = r.json()
        ids.append(r.headers[HEADER])
        assert body["conversation_id"] == ids[-1]
        assert body["accounting"]["turn"] if "turn" in body["accounting"] else True
        history += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"next {turn}"}]
    assert len(set(ids)) == 1, ids
    conv = rt.get(ids[0])
    assert conv.inferred == "openai-chat"
    assert [t.index for t in conv.turns] == [0, 1, 2]
    second = conv.turns[1].steps[0]
    # The second turn's prompt came from the chain: only the new message and the fork were prefilled.
    assert second.cached_input_tokens > 0
    assert second.cached_input_tokens + second.host_loaded_tokens + second.uncached_prefill_tokens == \
        second.prompt_tokens


def test_retry_replays_the_last_step(live, rt):
    messages = [{"role": "system", "content": system()}, {"role": "user", "content": "Say something"}]
    first = chat(live, messages)
    again = chat(live, messages)
    assert first.status_code == again.status_code == 200
    cid = first.headers[HEADER]
    assert again.headers[HEADER] == cid
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert len(rt.get(cid).turns) == 1  # a retry is never a second turn


def test_other_history_starts_a_new_conversation(live, rt):
    sys_text = system()
    first = chat(live, [{"role": "system", "content": sys_text}, {"role": "user", "content": "One"}])
    cid = first.headers[HEADER]
    before = rt.describe(cid)
    answer = first.json()["choices"][0]["message"]["content"]
    edited = chat(live, [{"role": "system", "content": sys_text}, {"role": "user", "content": "One, edited"},
                         {"role": "assistant", "content": answer}, {"role": "user", "content": "Two"}])
    assert edited.status_code == 200
    assert edited.headers[HEADER] != cid
    assert rt.describe(cid)["trace"] == before["trace"]  # the stored conversation is unchanged


def test_tenants_never_share(live, rt):
    messages = [{"role": "system", "content": system()}, {"role": "user", "content": "Same words"}]
    a, b = chat(live, messages, key="key-a"), chat(live, messages, key="key-b")
    assert a.headers[HEADER] != b.headers[HEADER]


def test_openai_sdk_tool_loop(live, rt):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="key-a")
    sys_text = system()
    messages = [{"role": "system", "content": sys_text}, {"role": "user", "content": "Weather in Paris?"}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=TOOLS,
                                                           max_tokens=4)
    cid = raw.headers[HEADER]
    done = raw.parse()
    assert done.model == "tiny"
    messages.append(done.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "And Oslo?"})
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=TOOLS,
                                                           max_tokens=4)
    assert raw.headers[HEADER] == cid
    assert len(rt.get(cid).turns) == 2


def test_anthropic_sdk_loop_and_served_names(live, rt):
    client = anthropic.Anthropic(base_url=live.url, api_key="key-a")
    sys_text = system()
    messages = [{"role": "user", "content": "Hello"}]
    ids = []
    for turn in range(2):
        raw = client.messages.with_raw_response.create(model="claude-sonnet-4-5[1m]", system=sys_text,
                                                       messages=messages, max_tokens=8)
        msg = raw.parse()
        assert msg.model == "claude-sonnet-4-5"
        assert msg.stop_reason == "max_tokens"
        assert msg.usage.output_tokens == 8
        ids.append(raw.headers[HEADER])
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                     {"role": "user", "content": f"more {turn}"}]
    assert len(set(ids)) == 1
    assert rt.get(ids[0]).inferred == "anthropic"


def test_listed_and_counted(live, rt):
    """Inferred conversations are listed to their tenant, marked with their
    protocol, and the stateless requests counted by how they were matched."""
    messages = [{"role": "system", "content": system()}, {"role": "user", "content": "List me"}]
    first = chat(live, messages)
    cid = first.headers[HEADER]
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "again"}]
    assert chat(live, messages).headers[HEADER] == cid

    def listing(key: str) -> dict:
        r = httpx.get(f"{live.url}/v1/conversations", headers={"authorization": f"Bearer {key}"},
                      params={"limit": 1000})
        assert r.status_code == 200, r.text
        return {c["id"]: c for c in r.json()["data"]}

    mine = listing("key-a")[cid]
    assert (mine["inferred"], mine["turns"], mine["tenant"], mine["state"]) == ("openai-chat", 2, "tenant-a", "idle")
    assert cid not in listing("key-b") and cid in listing("admin-key")
    metrics = httpx.get(f"{live.url}/metrics", headers={"authorization": "Bearer admin-key"}).text
    counts = {how: float(line.rsplit(" ", 1)[1]) for how in ("history", "new", "retry", "session_key")
              for line in metrics.splitlines() if line.startswith(f'session_runtime_stateless_requests_total{{match="{how}"')}
    assert counts["history"] >= 1 and counts["new"] >= 1, counts
    assert "session_runtime_conversations_inferred " in metrics


def test_clear_thinking_keeps_the_last_turns_thinking(live, rt):
    """Claude Code's context_management: clear_thinking with keep 1 over two
    earlier thinking turns clears the older one: the prompt is shorter than
    under keep all by the cleared tokens, the answer reports one cleared turn,
    and the prefix before the cleared block is still read from the cache."""
    sys_text = system()
    results = {}
    for key, keep in (("key-a", {"type": "thinking_turns", "value": 1}), ("key-b", "all")):
        client = anthropic.Anthropic(base_url=live.url, api_key=key)
        edits = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}}
        messages = [{"role": "user", "content": "Think about it"}]
        for turn in range(3):
            raw = client.messages.with_raw_response.create(
                model="claude-sonnet-4-5", system=sys_text, messages=messages, max_tokens=6,
                thinking={"type": "adaptive"}, extra_body={**edits, "temperature": 0})
            msg, sent = raw.parse(), list(messages)
            assert msg.content[0].type == "thinking"
            messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                         {"role": "user", "content": f"and then {turn}"}]
        results[key] = (raw.headers[HEADER], msg, json.loads(raw.http_response.text))
        if key == "key-a":  # count_tokens of the last request: after the edit, and before it
            counted = httpx.post(f"{live.url}/v1/messages/count_tokens", headers={"x-api-key": key}, json={
                "model": "claude-sonnet-4-5", "system": sys_text, "messages": sent, "thinking": {"type": "adaptive"},
                **edits}).json()
    (cid, msg, body), (_, kept, _) = results["key-a"], results["key-b"]
    applied = body["context_management"]["applied_edits"]
    assert [e["cleared_thinking_turns"] for e in applied] == [1]
    cleared = applied[0]["cleared_input_tokens"]
    assert cleared > 0
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    whole = kept.usage.input_tokens + kept.usage.cache_read_input_tokens
    assert prompt < whole
    # count_tokens renders the request's text (the reasoning tokenized again, which for the tiny preset's
    # gibberish need not give back the generated ids): the same edit, counted on text.
    # The tiny preset's reasoning is byte soup whose text may tokenize to far more ids than were generated
    # (a reasoning of 6 generated ids counted 80 on text in one CI run of the whole suite), so count_tokens
    # is compared with itself: the edit takes the cleared reasoning's text away.
    original, edited = counted["context_management"]["original_input_tokens"], counted["input_tokens"]
    assert original - edited >= 1
    conv = rt.get(cid)
    assert len(conv.turns) == 3 and conv.policy.name == "keep_last_k" and conv.policy.keep_last_k == 1
    step = conv.turns[2].steps[0]
    assert step.cached_input_tokens + step.host_loaded_tokens >= len(rt.tokenizer.encode(sys_text)) // 16 * 16


def test_racing_retries_store_one_turn(live, rt):
    """The same first request sent four times at once (a harness retrying
    before its first answer came): one conversation, one turn, one answer."""
    from concurrent.futures import ThreadPoolExecutor

    messages = [{"role": "system", "content": system()}, {"role": "user", "content": "Race me"}]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(live, messages), range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    ids = {r.headers[HEADER] for r in answers}
    assert len(ids) == 1, ids
    assert len(rt.get(ids.pop()).turns) == 1
    assert len({json.dumps(r.json()["choices"][0]["message"]) for r in answers}) == 1
    # Later steps race the same way: the continuation four times at once is one second turn.
    cid = answers[0].headers[HEADER]
    messages += [{"role": "assistant", "content": answers[0].json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Again"}]
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda _: chat(live, messages), range(4)))
    assert [r.status_code for r in again] == [200] * 4 and {r.headers[HEADER] for r in again} == {cid}
    assert len(rt.get(cid).turns) == 2


def test_a_tenant_at_its_cap_loses_its_oldest_inferred_conversation(monkeypatch):
    """Stateless traffic is never refused for the tenant's conversation cap:
    the least recently used inferred conversation makes room. An explicit
    conversation is never evicted for it, and inferred ones expire after the
    idle TTL (their records deleted)."""
    import session_runtime.runtime.stateless as stateless

    with served(max_conversations_per_tenant=3, session_idle_ttl_s=60) as live:
        rt = live.runtime
        explicit = rt.create_conversation("An explicit one.")
        ids = []
        for i in range(4):
            r = chat(live, [{"role": "system", "content": system()}, {"role": "user", "content": f"n{i}"}], key=None)
            assert r.status_code == 200, r.text
            ids.append(r.headers[HEADER])
        # Cap 3: the explicit conversation and the two most recent inferred ones.
        assert set(rt.conversations) == {explicit, ids[2], ids[3]}
        # An hour later (the index's clock and the sweep's), the inferred ones are gone; the explicit one stays.
        clock = rt.sessions._clock
        monkeypatch.setattr(rt.sessions, "_clock", lambda: clock() + 3600)
        monkeypatch.setattr(stateless.time, "monotonic", lambda: clock() + 3600)
        r = chat(live, [{"role": "system", "content": system()}, {"role": "user", "content": "late"}], key=None)
        assert r.status_code == 200
        assert set(rt.conversations) == {explicit, r.headers[HEADER]}
        rt.check_integrity()


def test_the_fields_harnesses_send_are_accepted(live, rt):
    """Each shape the harnesses send (../shared/HARNESSES.md) is answered 200
    with the conversation named: Claude Code's Messages fields, Codex's
    Responses fields, the Chat fields SDK agents set."""
    auth = {"authorization": "Bearer key-a"}
    messages = {"model": "claude-sonnet-4-5[1m]", "max_tokens": 4, "system": [
        {"type": "text", "text": system(), "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": "<system-reminder>Be brief.</system-reminder>"}],
        "thinking": {"type": "adaptive", "display": "summarized"}, "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"session_id": uuid.uuid4().hex})},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, "stream": True}
    r = httpx.post(f"{live.url}/v1/messages?beta=true", json=messages, timeout=120, headers={
        **auth, "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,some-future-beta-2027-01-01",
        "x-claude-code-session-id": uuid.uuid4().hex})
    assert r.status_code == 200 and "event: message_stop" in r.text, r.text
    assert rt.get(r.headers[HEADER]).inferred == "anthropic"
    responses = {"model": "tiny", "instructions": system(), "store": False, "stream": True,
                 "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Go"}]},
                           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                 "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
                 "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
                 "prompt_cache_key": uuid.uuid4().hex, "client_metadata": {"turn": "1"}, "max_output_tokens": 4}
    r = httpx.post(f"{live.url}/v1/responses", json=responses, headers=auth, timeout=120)
    assert r.status_code == 200 and "response.incomplete" in r.text, r.text
    assert rt.get(r.headers[HEADER]).inferred == "openai-responses"
    r = chat(live, [{"role": "system", "content": system()}, {"role": "user", "content": "Hi"}],
             reasoning_effort="high", user="someone")
    assert r.status_code == 200, r.text


def test_clear_tool_uses_forks_at_the_first_cleared_result(live, rt):
    """clear_tool_uses_20250919 over a history of three tool uses: the prompt
    shows the cleared results as the placeholder (the stored trace keeps them
    as sent), the answer reports them, count_tokens counts after the edit, and
    a later request that clears more forks the chain at the first newly
    cleared result: the prefix before it is read from the cache, the rest is
    prefilled as `tool_uses_cleared`; a request without the edit clears nothing."""
    from session_runtime.tool_clearing import PLACEHOLDER

    sys_text = system()
    messages = [{"role": "user", "content": "Sum up"}]  # no tools offered: the tiny preset's context is short
    for i in range(3):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "read",
                                                        "input": {"p": f"f{i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                   "content": f"file {i}: " + "x = 1; " * 4}]}]

    def edit(keep):  # every turn keeps its thinking: the only fork is the clearing's
        return {"thinking": {"type": "adaptive"}, "context_management": {"edits": [
            {"type": "clear_thinking_20251015", "keep": "all"},
            {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
             "keep": {"type": "tool_uses", "value": keep}}]}}

    def send(messages, key="key-a", **extra):
        body = {"model": "claude-sonnet-4-5", "system": sys_text, "messages": messages,
                "max_tokens": 4, "temperature": 0, **extra}
        r = httpx.post(f"{live.url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=120)
        assert r.status_code == 200, r.text
        return r

    first = send(messages, **edit(2))  # keep 2 of 3: the first result is cleared
    cid = first.headers[HEADER]
    applied = first.json()["context_management"]["applied_edits"]
    assert [(e["type"], e["cleared_tool_uses"]) for e in applied] == [("clear_tool_uses_20250919", 1)]
    whole = send(messages, key="key-b", thinking={"type": "adaptive"}, context_management={"edits": [
        {"type": "clear_thinking_20251015", "keep": "all"}]})  # nothing cleared, in another tenant's conversation
    assert whole.json()["context_management"] == {"applied_edits": []}
    usage = lambda r: r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"]  # noqa: E731
    assert usage(whole) - usage(first) == applied[0]["cleared_input_tokens"] > 0
    conv = rt.get(cid)
    assert [m.content for m in conv.history if m.role == "tool"][0] == PLACEHOLDER
    assert PLACEHOLDER not in [m.message.content for m in conv.trace]

    counted = httpx.post(f"{live.url}/v1/messages/count_tokens", headers={"x-api-key": "key-a"}, json={
        "model": "claude-sonnet-4-5", "system": sys_text, "messages": messages, **edit(2)}).json()
    assert counted["input_tokens"] == usage(first)
    assert counted["context_management"]["original_input_tokens"] == usage(whole)

    # The next turn clears one more (keep 1): the chain forks at the second result.
    messages += [{"role": "assistant", "content": first.json()["content"] or [{"type": "text", "text": ""}]},
                 {"role": "user", "content": "And now?"}]
    second = send(messages, **edit(1))
    assert second.headers[HEADER] == cid
    assert second.json()["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 2
    conv = rt.get(cid)
    step = conv.turns[-1].steps[0]
    reasons = {e["reason"]: e["tokens"] for e in step.uncached}
    assert reasons.get("tool_uses_cleared", 0) > 0, step.uncached
    assert step.rules == {"reasoning": {"rule": "clear_thinking_20251015", "policy": "keep", "keep_last_k": 1},
                          "tool_uses": {"rule": "clear_tool_uses_20250919", "cleared": 2, "cleared_inputs": 0}}
    # What comes before the second result (system, tools, the task, the first use, the second call) is reused.
    tpl = rt.template(conv.template)
    keep = conv.policy.kept_turns(conv.closed_turns)
    before = tpl.rendered_length(conv.system, conv.tools, conv.history[:4], keep, False)
    assert step.cached_input_tokens + step.host_loaded_tokens >= before // 16 * 16 > 0
    assert [m.content for m in conv.history if m.role == "tool"][:3] == [PLACEHOLDER] * 2 + ["file 2: " + "x = 1; " * 4]

    # Without the edit nothing is cleared: the stored results come back into the prompt.
    messages += [{"role": "assistant", "content": second.json()["content"] or [{"type": "text", "text": ""}]},
                 {"role": "user", "content": "Once more"}]
    third = send(messages, thinking={"type": "adaptive"})
    assert third.headers[HEADER] == cid and "context_management" not in third.json()
    assert PLACEHOLDER not in [m.content for m in rt.get(cid).history]


def test_clear_tool_uses_streamed_through_the_sdk(live, rt):
    """The same edit through the Anthropic SDK's beta stream: the final
    message_delta reports the applied edits, the streamed usage counts the
    prompt after them (as count_tokens does), and the stream's echo continues
    the one inferred conversation, whose prompt shows the cleared result as the
    placeholder."""
    from session_runtime.tool_clearing import PLACEHOLDER

    client = anthropic.Anthropic(base_url=live.url, api_key="key-a")
    sys_text = system()
    messages = [{"role": "user", "content": "Read both"}]
    for i in range(2):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_s{i}", "name": "read",
                                                        "input": {"p": f"g{i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_s{i}",
                                                   "content": f"file {i}: " + "y = 2; " * 4}]}]
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    cids = []
    for turn in range(2):
        with client.beta.messages.with_streaming_response.create(
                model="claude-sonnet-4-5", system=sys_text, messages=messages, max_tokens=4,
                stream=True, betas=["context-management-2025-06-27"], context_management=edits) as raw:
            cids.append(raw.headers[HEADER])
            events = [json.loads(line[5:]) for line in raw.iter_lines() if line.startswith("data:")]
        delta = next(e for e in events if e["type"] == "message_delta")
        applied = delta["context_management"]["applied_edits"]
        assert [(e["type"], e["cleared_tool_uses"]) for e in applied] == [("clear_tool_uses_20250919", 1)]
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        counted = client.beta.messages.count_tokens(model="claude-sonnet-4-5", system=sys_text, messages=messages,
                                                    betas=["context-management-2025-06-27"],
                                                    context_management=edits)
        assert start["input_tokens"] + start["cache_read_input_tokens"] == counted.input_tokens
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        messages += [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                     {"role": "user", "content": f"next {turn}"}]
    assert cids[0] == cids[1]
    assert [m.content for m in rt.get(cids[0]).history if m.role == "tool"][0] == PLACEHOLDER
