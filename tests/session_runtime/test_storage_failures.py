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
