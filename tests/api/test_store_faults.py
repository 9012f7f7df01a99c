"""The store's faults under traffic, as an operator meets them: PostgreSQL
restarted (crashed, then started again) while `session-runtime serve` takes
steps. While it is down, steps fail with the retryable 503 and change
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
            acked[cid] = []
            with httpx.Client(base_url=url, timeout=30) as c:
                k = 0
                while not stop.is_set():
                    text = f"message {k}"
                    r = c.post(f"/v1/conversations/{cid}/messages",
                               json={"content": text, "forced": {"content": f"answer {k}"}})
                    if r.status_code == 200:
                        acked[cid].append(text)
                        k += 1
                    elif r.status_code == 503:  # nothing changed: the same message again
                        retried.append(time.monotonic())
                        time.sleep(0.1)
                    else:
                        refused.append((r.status_code, r.text[:300]))
                        return

        threads = [threading.Thread(target=agent, args=(cid,)) for cid in cids]
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
        with httpx.Client(base_url=url, timeout=30) as c:
            for cid in cids:
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
            for cid in cids:
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
