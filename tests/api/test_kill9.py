"""`kill -9` of a loaded `session-runtime serve`, then a restart on the same
data folder (or the same PostgreSQL store): every step the server
acknowledged (HTTP 200) is there, each conversation's record is whole, and
the conversations go on."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.api.conftest import serve_cli


FLAGS = ("--max-context", "2048", "--pool-tokens", "16384", "--no-access-log")


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_kill_9_under_load_loses_no_acknowledged_step(tmp_path, store, request):
    flags = FLAGS if store == "sqlite" else (*FLAGS, "--store", request.getfixturevalue("pg_url"))
    proc, url = serve_cli(tmp_path, *flags)
    acked: dict[str, list[str]] = {}  # conversation -> user messages of acknowledged steps
    stop = threading.Event()
    try:
        cids = [httpx.post(f"{url}/v1/conversations", json={"system": f"Load {i}."}).json()["id"] for i in range(4)]

        def load(cid: str) -> None:
            acked[cid] = []
            with httpx.Client(base_url=url, timeout=30) as c:
                k = 0
                while not stop.is_set():
                    text = f"message {k}"
                    try:
                        r = c.post(f"/v1/conversations/{cid}/messages",
                                   json={"content": text, "forced": {"content": f"answer {k}"}})
                    except httpx.HTTPError:
                        return  # the server is gone: this step was never acknowledged
                    if r.status_code == 200:
                        acked[cid].append(text)
                    k += 1

        threads = [threading.Thread(target=load, args=(cid,)) for cid in cids]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(len(v) for v in acked.values()) < 20:
            assert time.monotonic() < deadline, "no load"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-step, mid-write
        proc.wait(10)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc, url = serve_cli(tmp_path, *flags)  # another port: the address is only the client's concern
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            for cid in cids:
                d = c.get(f"/v1/conversations/{cid}").json()
                users = [m["content"] for m in d["trace"] if m["role"] == "user"]
                # Every acknowledged step is there, in order; at most one more (saved, then the kill before its answer).
                assert users[: len(acked[cid])] == acked[cid] and len(users) - len(acked[cid]) <= 1, (cid, users)
                assert len(d["turns"]) == len(users) and all(t["closed"] for t in d["turns"])  # whole records
                r = c.post(f"/v1/conversations/{cid}/messages", json={"content": "after", "forced": {"content": "ok"}})
                assert r.status_code == 200 and r.json()["turn"] == len(users)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
