"""SIGTERM stops `session-runtime serve` within seconds, even during a long
generation: the step in flight fails with 503 and changes nothing."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.api.conftest import serve_cli


def test_sigterm_during_a_long_generation_exits_within_seconds(tmp_path):
    proc, url = serve_cli(tmp_path, "--max-context", "4096", "--pool-tokens", "8192")
    try:
        cid = httpx.post(f"{url}/v1/conversations", json={"system": "Long."}).json()["id"]
        answer = {}

        def long_step():
            answer["r"] = httpx.post(f"{url}/v1/conversations/{cid}/messages",
                                     json={"content": "Write a lot.", "max_tokens": 3000}, timeout=120)

        t = threading.Thread(target=long_step)
        t.start()
        time.sleep(3)  # well inside the generation (3,000 tokens take about a minute here)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15
        t.join(30)
        r = answer["r"]
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Nothing changed: the saved conversation has no turn.
    from session_runtime.store.sqlite import Store

    store = Store(tmp_path / "conversations.sqlite3")
    try:
        (conv,) = store.load_all()
        assert conv.id == cid and conv.turns == []
    finally:
        store.close()
