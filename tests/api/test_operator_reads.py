"""Operator routes never wait on the engine: with its lock held by another
thread (a long step, or anything else), /health, /metrics, /debug/tree and a
conversation's GET still answer, from the last consistent read."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from session_runtime import Runtime, RuntimeConfig
from session_runtime.api.app import create_app


def test_operator_routes_answer_while_the_engine_lock_is_held():
    rt = Runtime(RuntimeConfig(model="tiny", pool_tokens=4096, max_context=512), background=False)
    try:
        client = TestClient(create_app(rt))
        read = rt.create_conversation(system="Read before.")
        rt.send_message(read, "Hello", max_tokens=2)
        client.get("/metrics")
        before = {path: client.get(path).json() for path in ("/debug/tree", f"/v1/conversations/{read}")}
        unread = rt.create_conversation(system="Never read.")  # after /debug/tree, which reads every chain
        held, done = threading.Event(), threading.Event()

        def hold():
            with rt.engine.lock:
                held.set()
                done.wait(60)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        try:
            assert client.get("/health").status_code == 200
            metrics = client.get("/metrics")
            assert metrics.status_code == 200 and "pool_free_tokens" in metrics.text
            assert client.get("/debug/tree").json()["nodes"] == before["/debug/tree"]["nodes"]
            got = client.get(f"/v1/conversations/{read}").json()
            assert got["chain"] == before[f"/v1/conversations/{read}"]["chain"]  # the last read
            fresh = client.get(f"/v1/conversations/{unread}").json()
            assert fresh["id"] == unread and fresh["chain"]["cached_tokens"] is None  # not read yet: unknown
        finally:
            done.set()
            holder.join()
        assert client.get(f"/v1/conversations/{unread}").json()["chain"]["cached_tokens"] == 0
        rt.check_integrity()
    finally:
        rt.close()
