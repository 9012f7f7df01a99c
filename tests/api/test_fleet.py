"""Two `session-runtime serve` processes over one PostgreSQL store (a real
server, tests/postgres.py), the embedded engine in each:

- any process answers any route: each conversation is served by one process
  (its owner, chosen by rendezvous hashing), whichever process the request
  reached; `/health` names the process and the live ones;
- `kill -9` of one under traffic: every acknowledged step is in the store
  once, in order (the only others: steps in flight at the kill), and every
  conversation goes on through the other process, which took the dead one's
  over and prefilled their KV again (`backend_lost`)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psycopg

from tests.api.conftest import serve_cli

FLAGS = ("--max-context", "2048", "--pool-tokens", "16384", "--no-access-log")
MEMBER, VIA = "x-session-runtime-member", "x-session-runtime-via"


def _start(tmp_path, name: str, url: str, ttl: float = 6.0):
    """A member; with the long TTL a loaded machine's pause never passes for a death."""
    return serve_cli(tmp_path / name, *FLAGS, "--store", url, "--member-ttl-s", str(ttl))


def _stop(*procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except Exception:
            proc.kill()


def test_any_process_answers_and_one_serves_each_conversation(tmp_path, pg_url):
    (a, url_a), (b, url_b) = _start(tmp_path, "a", pg_url), _start(tmp_path, "b", pg_url)
    try:
        deadline = time.monotonic() + 30
        while True:  # each sees the other from its next beat on (every ttl/3)
            health = [httpx.get(f"{u}/health").json() for u in (url_a, url_b)]
            members = {h["member"] for h in health}
            if all(set(h["members"]) == members for h in health):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        assert len(members) == 2
        cids = [httpx.post(f"{u}/v1/conversations", json={"system": f"Fleet {i}."}).json()["id"]
                for i, u in enumerate((url_a, url_b) * 3)]
        owners = {}
        for k in range(3):
            for i, cid in enumerate(cids):
                u = (url_a, url_b)[(i + k) % 2]  # each conversation reaches both processes
                r = httpx.post(f"{u}/v1/conversations/{cid}/messages",
                               json={"content": f"m{k}", "forced": {"content": f"a{k}"}}, timeout=60)
                assert r.status_code == 200, r.text
                owner = owners.setdefault(cid, r.headers[MEMBER])
                assert r.headers[MEMBER] == owner  # one process serves it, always
                relayed = health[(i + k) % 2]["member"] != owner
                assert (VIA in r.headers) == relayed
        # Each created where it was asked for (its id was drawn for that process), so both serve some.
        assert set(owners.values()) == members
        with psycopg.connect(pg_url) as db:
            stored = dict(db.execute("SELECT id, owner FROM conv").fetchall())
        assert stored == owners
        d = httpx.get(f"{url_a}/v1/conversations/{cids[1]}").json()  # read through either
        assert [m["content"] for m in d["trace"] if m["role"] == "user"] == ["m0", "m1", "m2"]
        _openai_sdk_streams_through_a_relay(pg_url, {h["member"]: u for h, u in zip(health, (url_a, url_b))})
        _bad_input_is_refused_where_it_lands(url_a)
        _stateless_loop_through_both(url_a, url_b)
    finally:
        _stop(a, b)


def _openai_sdk_streams_through_a_relay(pg_url: str, urls: dict) -> None:
    """The official SDK, to the process that does not own the conversation:
    a chat completion with conversation_id, streamed, relayed chunk by chunk."""
    import openai

    sdk = {m: openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0) for m, u in urls.items()}
    messages = [{"role": "system", "content": "Relayed."}, {"role": "user", "content": "Hello"}]
    first = next(iter(sdk.values())).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, extra_body={"conversation_id": "sdk-fleet", "create": True})
    with psycopg.connect(pg_url) as db:
        (owner,) = db.execute("SELECT owner FROM conv WHERE id = 'sdk-fleet'").fetchone()
    other = next(m for m in sdk if m != owner)
    m = first.choices[0].message
    again = [*messages, {"role": "assistant", "content": m.content, "reasoning_content": m.model_extra.get(
        "reasoning_content")}, {"role": "user", "content": "Again"}]
    raw = sdk[other].chat.completions.with_raw_response.create(
        model="tiny", messages=again, max_tokens=4, stream=True, extra_body={"conversation_id": "sdk-fleet"})
    assert (raw.headers[MEMBER], raw.headers[VIA]) == (owner, other)  # served by the owner, relayed
    chunks = list(raw.parse())
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason in ("stop", "length")
    d = httpx.get(f"{urls[other]}/v1/conversations/sdk-fleet").json()
    assert [t["content"] for t in d["trace"] if t["role"] == "user"] == ["Hello", "Again"]


def _stateless_loop_through_both(url_a: str, url_b: str) -> None:
    """A stateless chat loop (no conversation named: a harness's), its
    requests sent to each process in turn: one conversation, served by the
    process that created it; the other finds it by its history in the store
    and relays the request there."""
    HEADER = "x-session-runtime-conversation"
    messages = [{"role": "system", "content": "A stateless fleet loop."}, {"role": "user", "content": "Hi"}]
    seen = []
    for k in range(4):
        url = (url_a, url_b)[k % 2]
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        seen.append((r.headers[HEADER], r.headers[MEMBER], VIA in r.headers))
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"next {k}"}]
    assert len({cid for cid, _, _ in seen}) == 1 and len({member for _, member, _ in seen}) == 1, seen
    assert [via for _, _, via in seen] == [False, True, False, True], seen
    d = httpx.get(f"{url_b}/v1/conversations/{seen[0][0]}").json()
    assert d["inferred"] == "openai-chat" and len(d["turns"]) == 4


def _bad_input_is_refused_where_it_lands(url: str) -> None:
    """What the relay reads of a request (a body that is not an object, an id
    with odd characters) is never a 500."""
    r = httpx.post(f"{url}/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [], "conversation_id": 7})
    assert 400 <= r.status_code < 500, r.text
    for cid in ("a%2Fb", "%25", "x" * 200):
        assert httpx.get(f"{url}/v1/conversations/{cid}").status_code == 404


def test_kill_9_of_one_process_loses_no_acknowledged_step(tmp_path, pg_url):
    (a, url_a), (b, url_b) = _start(tmp_path, "a", pg_url, ttl=2), _start(tmp_path, "b", pg_url, ttl=2)
    acked: dict[str, list[str]] = {}  # conversation -> user messages of acknowledged steps
    uncertain: dict[str, list[str]] = {}  # sent, and no answer came (the kill)
    killed, stop = threading.Event(), threading.Event()
    try:
        cids = [httpx.post(f"{u}/v1/conversations", json={"system": f"Load {i}."}).json()["id"]
                for i, u in enumerate((url_a, url_b) * 3)]

        def load(i: int, cid: str) -> None:
            acked[cid], uncertain[cid] = [], []
            k = 0
            while not stop.is_set():
                # Alternating between the processes until one is killed; then the one left.
                url = url_b if killed.is_set() else (url_a, url_b)[(i + k) % 2]
                text = f"message {k}"
                try:
                    r = httpx.post(f"{url}/v1/conversations/{cid}/messages",
                                   json={"content": text, "forced": {"content": f"answer {k}"}}, timeout=30)
                except httpx.HTTPError:
                    uncertain[cid].append(text)
                    k += 1
                    continue
                if r.status_code == 200:
                    acked[cid].append(text)
                elif r.status_code == 503:  # the owner is gone and its beat has not lapsed: retry later
                    time.sleep(0.3)
                elif r.status_code == 502:  # relayed to the owner as it died: stored or not, no one knows
                    uncertain[cid].append(text)
                    time.sleep(0.3)
                else:
                    raise AssertionError(r.text)
                k += 1

        threads = [threading.Thread(target=load, args=(i, cid)) for i, cid in enumerate(cids)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(len(v) for v in acked.values()) < 30:
            assert time.monotonic() < deadline, "no load"
            time.sleep(0.05)
        a.send_signal(signal.SIGKILL)  # mid-step, mid-write
        a.wait(10)
        killed.set()
        before = {cid: len(v) for cid, v in acked.items()}
        deadline = time.monotonic() + 90
        while not all(len(acked[cid]) >= before[cid] + 3 for cid in cids):  # each goes on, through b
            assert time.monotonic() < deadline, {cid: (before[cid], len(acked[cid])) for cid in cids}
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(60)
        assert set(httpx.get(f"{url_b}/health").json()["members"]) == {httpx.get(f"{url_b}/health").json()["member"]}
        lost = 0
        with httpx.Client(base_url=url_b, timeout=30) as c:
            for cid in cids:
                d = c.get(f"/v1/conversations/{cid}").json()
                users = [m["content"] for m in d["trace"] if m["role"] == "user"]
                assert len(users) == len(set(users)), users  # none twice
                assert [u for u in users if u in acked[cid]] == acked[cid], (cid, users, acked[cid])  # all, in order
                assert set(users) - set(acked[cid]) <= set(uncertain[cid]), (cid, users)  # others: in flight at the kill
                assert len(d["turns"]) == len(users) and all(t["closed"] for t in d["turns"])  # whole records
                reasons = [u["reason"] for t in d["turns"] for s in t["steps"] for u in (s.get("uncached") or [])]
                lost += "backend_lost" in reasons
        assert lost >= 1  # the dead process's conversations were prefilled again where they went on
    finally:
        stop.set()
        _stop(a, b)
