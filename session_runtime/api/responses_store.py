"""Stored Responses (`store: true`): which conversation of the runtime each
response belongs to, where in it the response ended, and the response object
as it was answered (for `GET /v1/responses/{id}`).

A stored response is a conversation of the runtime (runtime.py keeps its
turns, its KV chain and its tenant); this table only maps response ids onto
it. It lives next to the runtime's store (`responses.sqlite3` in the data
folder), so a restarted server still continues and returns its responses;
without a data folder it is kept in memory, as the conversations are.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL,
    tenant TEXT,
    position INTEGER NOT NULL,
    calls TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_conversation ON responses (conversation_id, position);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    conversation_id: str
    tenant: Optional[str]
    # Messages in the conversation's trace once this response was committed: the
    # response is the conversation's latest while the trace still has this length.
    # (Not the conversation's version, which a restart does not keep.)
    position: int
    calls: dict[str, str]  # the response's call_id -> the runtime's id of that tool call
    body: dict  # the response object as answered


class ResponseStore:
    """The response table, in SQLite at `path` or in memory (None). Thread-safe."""

    def __init__(self, path: Optional[Path]):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        with self._lock, self._db:
            self._db.executescript(_SCHEMA)

    def put(self, rec: StoredResponse) -> None:
        """Store (or overwrite) one response. Raises sqlite3.Error."""
        row = (rec.id, rec.conversation_id, rec.tenant, rec.position, json.dumps(rec.calls),
               json.dumps(rec.body, ensure_ascii=False))
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)

    def get(self, rid: str) -> Optional[StoredResponse]:
        with self._lock:
            row = self._db.execute("SELECT * FROM responses WHERE id = ?", (rid,)).fetchone()
        return None if row is None else _record(row)

    def latest(self, conversation_id: str) -> Optional[StoredResponse]:
        """The conversation's response that ended furthest along, if any is stored."""
        with self._lock:
            row = self._db.execute("SELECT * FROM responses WHERE conversation_id = ? ORDER BY position DESC "
                                   "LIMIT 1", (conversation_id,)).fetchone()
        return None if row is None else _record(row)

    def count(self, conversation_id: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses WHERE conversation_id = ?",
                                    (conversation_id,)).fetchone()[0]

    def delete(self, rid: str) -> bool:
        """Forget one response; returns whether it was stored."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _record(row: tuple) -> StoredResponse:
    rid, cid, tenant, position, calls, body = row
    return StoredResponse(rid, cid, tenant, position, json.loads(calls), json.loads(body))
