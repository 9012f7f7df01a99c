"""SQLite persistence of the trace and canonical-history layers.

Each conversation is one row (its layers as JSON), written in one transaction
before a step's response returns. Physical state (KV) is never stored: a
restarted server rebuilds it by prefill on the next step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Iterator

from session_runtime.accounting import StepAccounting
from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.templates.base import Message, ToolCall

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    updated_at REAL NOT NULL DEFAULT (julianday('now'))
)
"""


def _message_to_dict(m: Message) -> dict:
    d = dataclasses.asdict(m)
    d["output_ids"] = list(m.output_ids)
    return d


def _message_from_dict(d: dict) -> Message:
    calls = tuple(ToolCall(**c) for c in d.get("tool_calls", ()))
    return Message(**{**d, "tool_calls": calls, "output_ids": tuple(d.get("output_ids", ()))})


def estimated_bytes(conv: Conversation) -> int:
    """About what the conversation would take in the store, without writing
    it out: its texts, tools and ids (for the per-tenant budget when nothing
    is stored)."""
    messages = [*conv.history, *(e.message for e in conv.trace)]
    return (len(conv.system or "") + sum(len(json.dumps(t, ensure_ascii=False)) for t in conv.tools)
            + sum(len(m.content) + len(m.reasoning) + 6 * len(m.output_ids) + 64 for m in messages))


def conversation_to_json(conv: Conversation) -> str:
    return json.dumps({
        "id": conv.id, "system": conv.system, "tools": conv.tools, "tenant": conv.tenant, "worker": conv.worker,
        "template": conv.template, "policy": dataclasses.asdict(conv.policy),
        "materialize": dataclasses.asdict(conv.materialize),
        "offload": dataclasses.asdict(conv.offload),
        "history": [_message_to_dict(m) for m in conv.history],
        "trace": [{"message": _message_to_dict(e.message), "step": e.step,
                   "finish_reason": e.finish_reason, "created_at": e.created_at} for e in conv.trace],
        "turns": [{**dataclasses.asdict(t), "steps": [dataclasses.asdict(s) for s in t.steps]} for t in conv.turns],
        "protocol": None if conv.protocol is None else {
            "turn": conv.protocol.turn,
            "pending_calls": [c.as_dict() for c in conv.protocol.pending_calls],
            "generated_ids": list(conv.protocol.generated_ids),
        },
    }, ensure_ascii=False)


def conversation_from_json(text: str) -> Conversation:
    d = json.loads(text)
    protocol = None
    if d["protocol"] is not None:
        p = d["protocol"]
        protocol = ProtocolState(p["turn"], tuple(ToolCall(**c) for c in p["pending_calls"]), tuple(p["generated_ids"]))
    return Conversation(
        id=d["id"], system=d["system"], tools=d["tools"], tenant=d["tenant"], template=d["template"],
        policy=ReasoningPolicy(**d["policy"]), materialize=MaterializeSettings(**d["materialize"]),
        offload=OffloadSettings(**d.get("offload", {})),
        history=[_message_from_dict(m) for m in d["history"]],
        trace=[TraceEntry(_message_from_dict(e["message"]), e["step"], e["finish_reason"], e["created_at"])
               for e in d["trace"]],
        turns=[TurnRecord(**{**t, "steps": [StepAccounting(**s) for s in t["steps"]]}) for t in d["turns"]],
        protocol=protocol, worker=d.get("worker"),
        # The KV is gone after a restart: the next step starts from nothing cached.
        canonical_kind="none",
    )


class Store:
    """One SQLite file; safe to call from several threads."""

    def __init__(self, path: Path):
        # The file holds every tenant's conversations: readable by its owner
        # only (SQLite gives its -wal and -shm files the same mode), in a new
        # folder only its owner may list; an older file is tightened too.
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(path, 0o600)
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()

    def save(self, conv: Conversation) -> int:
        """Write the conversation; returns the bytes it takes in the store."""
        data = conversation_to_json(conv)
        with self._lock:
            self._db.execute(
                "INSERT INTO conversations(id, data) VALUES(?, ?) "
                "ON CONFLICT(id) DO UPDATE SET data=excluded.data, updated_at=julianday('now')",
                (conv.id, data),
            )
        return len(data.encode("utf-8"))

    def delete(self, conversation_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def load_all(self) -> Iterator[Conversation]:
        for conv, _ in self.load_all_sized():
            yield conv

    def load_all_sized(self) -> Iterator[tuple[Conversation, int]]:
        """Each stored conversation and the bytes it takes in the store."""
        with self._lock:
            rows = self._db.execute("SELECT data FROM conversations ORDER BY updated_at").fetchall()
        for (data,) in rows:
            yield conversation_from_json(data), len(data.encode("utf-8"))

    def close(self) -> None:
        with self._lock:
            self._db.close()
