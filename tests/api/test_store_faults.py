"""The store's faults under traffic, as an operator meets them: PostgreSQL
restarted (crashed, then started again) while `session-runtime serve` takes
steps, on the session API and from a stateless harness session (Messages). While it is down, steps fail with the retryable 503 and change
nothing; once it is back they succeed again by themselves (the store
reconnects); every acknowledged step is stored, and nothing else is."""

from __future__ import annotations

import threading
import time

import httpx

from tests.api.conftest import serve_cli
from tests.postgres import PostgresServer

FLAGS = ("--max-context", "2048", "--pool-tokens", "16384", "--no-access-log")


def _drain(proc) -> None:
    """Read the server's output, so that its logging never blocks on a full pipe."""
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def test_postgresql_restarted_under_traffic_loses_no_acknowledged_step(tmp_path):
    pg = PostgresServer()  # its own: a crash must not touch the session's server
    store = pg.new_database()
    proc, url = serve_cli(tmp_path, *FLAGS, "--store", store)
    _drain(proc)
    acked: dict[str, list[str]] = {}
    refused: list[tuple[int, str]] = []  # answers other than 200 and the retryable 503
    retried: list[float] = []
    stop = threading.Event()
    try:
        cids = [httpx.post(f"{url}/v1/conversations", json={"system": f"Store {i}."}).json()["id"] for i in range(4)]

        def agent(cid: str) -> None:
            """Session API steps; `cid` None: stateless Messages requests, the
            whole history each time, as a harness sends them."""
            history: list[dict] = []
            with httpx.Client(base_url=url, timeout=30) as c:
                k = 0
                while not stop.is_set():
                    text = f"message {k}"
                    if cid is None:
                        r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": [
                            *history, {"role": "user", "content": text}]})
                    else:
                        r = c.post(f"/v1/conversations/{cid}/messages",
                                   json={"content": text, "forced": {"content": f"answer {k}"}})
                    if r.status_code == 200:
                        key = cid or r.headers["x-session-runtime-conversation"]
                        acked.setdefault(key, []).append(text)
                        if cid is None:
                            history += [{"role": "user", "content": text},
                                        {"role": "assistant", "content": r.json()["content"]}]
                        k += 1
                    elif r.status_code in (503, 529):  # nothing changed (529: Messages'): the same again
                        retried.append(time.monotonic())
                        time.sleep(0.1)
                    else:
                        refused.append((r.status_code, r.text[:300]))
                        return

        for cid in cids:
            acked[cid] = []
        threads = [threading.Thread(target=agent, args=(cid,)) for cid in [*cids, None]]
        for t in threads:
            t.start()

        def wait_for(n: int) -> None:
            deadline = time.monotonic() + 120
            while sum(len(v) for v in acked.values()) < n:
                assert time.monotonic() < deadline and not refused, (refused, acked)
                time.sleep(0.05)

        wait_for(12)
        pg.crash()  # mid-step, mid-write
        down_at = time.monotonic()
        time.sleep(3.0)
        during = sum(len(v) for v in acked.values())
        pg.start()
        up_at = time.monotonic()
        wait_for(during + 12)  # they go on by themselves
        stop.set()
        for t in threads:
            t.join(30)
        assert not refused, refused
        assert any(down_at < t < up_at for t in retried), "no step failed while PostgreSQL was down"
        assert len(acked) == len(cids) + 1, list(acked)  # the stateless session stayed one conversation
        with httpx.Client(base_url=url, timeout=30) as c:
            for cid in acked:
                users = [m["content"] for m in c.get(f"/v1/conversations/{cid}").json()["trace"] if m["role"] == "user"]
                assert users == acked[cid], (cid, users, acked[cid])
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)
    proc, url = serve_cli(tmp_path, *FLAGS, "--store", store)  # what the store holds, read by a new process
    _drain(proc)
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            for cid in acked:
                d = c.get(f"/v1/conversations/{cid}").json()
                users = [m["content"] for m in d["trace"] if m["role"] == "user"]
                assert users == acked[cid], (cid, users, acked[cid])
                assert len(d["turns"]) == len(users) and all(t["closed"] for t in d["turns"])
                r = c.post(f"/v1/conversations/{cid}/messages", json={"content": "after", "forced": {"content": "ok"}})
                assert r.status_code == 200 and r.json()["turn"] == len(users)
    finally:
        proc.terminate()
        proc.wait(30)
        pg.stop()
