"""The SQLite store's disk full: a step that cannot be saved is a clear 507
StorageFull, changes nothing (the conversation and the file are as before),
and the same step goes through once there is room again; a new process reads
every acknowledged step back.

SQLite fails a write that would grow the file past `PRAGMA max_page_count`
with SQLITE_FULL, "database or disk is full": the error a full disk gives,
raised at the same place, so the test fills the store that way rather than a
real disk."""

from __future__ import annotations

import pytest

from session_runtime.config import RuntimeConfig
from session_runtime.errors import StorageFull
from session_runtime.runtime import Runtime

FORCED = {"content": "Noted. " * 40}


def _runtime(folder) -> Runtime:
    return Runtime(RuntimeConfig(model="tiny", pool_tokens=16384, max_context=4096, data_dir=str(folder)),
                   background=False)


def test_a_full_store_refuses_the_step_with_507_and_keeps_everything(tmp_path):
    rt = _runtime(tmp_path)
    try:
        cid = rt.create_conversation(system="A store that fills up.")
        acked = []
        for k in range(3):
            rt.send_message(cid, f"message {k}", forced=FORCED)
            acked.append(f"message {k}")
        db = rt.store._db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full: not one more page
        before = rt.describe(cid)
        k = len(acked)
        with pytest.raises(StorageFull) as refused:
            for k in range(len(acked), len(acked) + 50):  # until a step needs a new page
                rt.send_message(cid, f"message {k}", forced=FORCED)
                acked.append(f"message {k}")
                before = rt.describe(cid)
        assert refused.value.status == 507 and "the store is full" in str(refused.value)
        after = rt.describe(cid)
        assert (after["trace"], after["turns"]) == (before["trace"], before["turns"])  # nothing changed
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.execute("PRAGMA max_page_count = 1073741823")  # room again
        rt.send_message(cid, f"message {k}", forced=FORCED)
        acked.append(f"message {k}")
        rt.check_integrity()
    finally:
        rt.close()
    rt = _runtime(tmp_path)  # what the file holds, read by a new process's runtime
    try:
        d = rt.describe(cid)
        assert [m["content"] for m in d["trace"] if m["role"] == "user"] == acked
        assert len(d["turns"]) == len(acked) and all(t["closed"] for t in d["turns"])
    finally:
        rt.close()
