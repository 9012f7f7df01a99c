"""A step or a delete that cannot be saved did not happen: the data file and
the conversation in memory agree, before and after a restart, and a retry
runs the step once."""

from __future__ import annotations

import sqlite3

import pytest

from session_runtime import Runtime, RuntimeConfig
from session_runtime.errors import StorageUnavailable


def _runtime(data_dir) -> Runtime:
    return Runtime(RuntimeConfig(model="tiny", pool_tokens=4096, max_context=512, data_dir=str(data_dir)),
                   background=False)


def _failing_once(monkeypatch, store, name: str) -> None:
    real = getattr(store, name)
    calls = []

    def fail_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        return real(*args)

    monkeypatch.setattr(store, name, fail_once)


def test_a_step_that_cannot_be_saved_changes_nothing_and_a_retry_runs_once(tmp_path, monkeypatch):
    rt = _runtime(tmp_path)
    try:
        cid = rt.create_conversation(system="Saved.")
        rt.send_message(cid, "One.", max_tokens=3)
        _failing_once(monkeypatch, rt.store, "save")
        with pytest.raises(StorageUnavailable) as err:
            rt.send_message(cid, "Two.", max_tokens=3)
        assert err.value.status == 503
        conv = rt.get(cid)
        assert len(conv.turns) == 1 and [m.content for m in conv.history if m.role == "user"] == ["One."]
        again = rt.send_message(cid, "Two.", max_tokens=3)
        assert again.turn == 1 and len(rt.get(cid).turns) == 2
        rt.check_integrity()
    finally:
        rt.close()
    rt = _runtime(tmp_path)  # a restart sees exactly the saved turns
    try:
        conv = rt.get(cid)
        assert [m.content for m in conv.history if m.role == "user"] == ["One.", "Two."]
    finally:
        rt.close()


def test_a_delete_that_cannot_be_saved_does_not_happen(tmp_path, monkeypatch):
    rt = _runtime(tmp_path)
    try:
        cid = rt.create_conversation(system="Kept.")
        rt.send_message(cid, "One.", max_tokens=2)
        chain = rt.engine.chain_tokens(cid)
        _failing_once(monkeypatch, rt.store, "delete")
        with pytest.raises(StorageUnavailable):
            rt.delete_conversation(cid)
        assert rt.get(cid).id == cid and rt.engine.chain_tokens(cid) == chain  # still there, chain and all
        rt.check_integrity()
    finally:
        rt.close()
    rt = _runtime(tmp_path)
    try:
        assert rt.get(cid).id == cid
        rt.delete_conversation(cid)
    finally:
        rt.close()
    rt = _runtime(tmp_path)
    try:
        assert cid not in rt.conversations  # a delete that was saved stays done
    finally:
        rt.close()


FORCED_ANSWER = {"reasoning": "Think it over at length first.", "content": "Done."}


def test_a_chain_worker_lost_after_the_step_leaves_the_step_standing(tmp_path, monkeypatch):
    """Holding the fork fails (the chain's worker went down after the step
    finished): the step is still answered and recorded, and the next one runs."""
    from session_runtime.errors import BackendUnavailable

    rt = _runtime(tmp_path)
    try:
        cid = rt.create_conversation(system="Worker gone.", policy="drop")

        def gone(*args, **kwargs):
            raise BackendUnavailable("SGLang worker w1 is down")

        monkeypatch.setattr(rt.backend, "lock_prefix", gone)
        step = rt.send_message(cid, "One.", forced=FORCED_ANSWER)
        assert step.content == "Done." and rt.get(cid).turns[0].closed
        assert rt.get(cid).turns[0].materialize.startswith("skipped: the chain's worker is gone")
        monkeypatch.undo()
        assert rt.send_message(cid, "Two.", max_tokens=2).turn == 1
        rt.check_integrity()
    finally:
        rt.close()


def test_a_commit_that_fails_half_way_changes_nothing(tmp_path, monkeypatch):
    rt = _runtime(tmp_path)
    try:
        cid = rt.create_conversation(system="Half way.", policy="drop")
        rt.send_message(cid, "One.", max_tokens=2)
        before = rt.describe(cid)

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the turn's close")

        monkeypatch.setattr(rt.turn_close, "close", broken)
        with pytest.raises(RuntimeError):
            rt.send_message(cid, "Two.", forced=FORCED_ANSWER)
        after = rt.describe(cid)
        # The trace and history were appended before the close: put back. The
        # chain is physical state: the step's KV stays cached, as on a failed save.
        assert {k: v for k, v in after.items() if k != "chain"} == {k: v for k, v in before.items() if k != "chain"}
        monkeypatch.undo()
        assert rt.send_message(cid, "Two.", max_tokens=2).turn == 1
    finally:
        rt.close()
