"""SQLite persistence of the trace and canonical-history layers.

A step writes what it added, in one transaction before its response returns:
its messages, trace entries and accounting as rows of their own, its turn's
record, and the conversation's small row (settings when they changed, state).
Nothing on a step's path writes the whole history again (delta.py finds
what changed by identity). Physical state (KV) is never stored: a restarted
server rebuilds it by prefill on the next step. A conversation that leaves
memory while this process runs (the runtime's bound on resident ones) parks
what the runtime knew of its KV beside it; only this process reads that back.

Start-up reads only each conversation's id, tenant, worker and size
(`index`); a conversation's rows are read at its first use (`load`). A store
written by the first schema (one JSON document per conversation) is migrated
once, in one transaction, when it is opened.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

from session_runtime.conversation import Conversation
from session_runtime.errors import StorageUnavailable
from session_runtime.inference import StoredInferred
from session_runtime.store.delta import Written, delta, written_of
from session_runtime.store.rows import conversation_of, legacy_conversation, parked_row, unpark

# One schema for SQLite and PostgreSQL: {now} is the dialect's clock, {rowid}
# SQLite's clustering clause.
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS conv (
    id TEXT PRIMARY KEY,
    tenant TEXT,
    worker TEXT,
    bytes BIGINT NOT NULL,
    head TEXT NOT NULL,
    state TEXT NOT NULL,
    parked TEXT,
    updated_at DOUBLE PRECISION NOT NULL DEFAULT ({now})
)""",
    """CREATE TABLE IF NOT EXISTS conv_rows (
    conv TEXT NOT NULL,
    kind INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    sub INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (conv, kind, seq, sub)
){rowid}""",
    # Inferred conversations' tail digests (inference.py), for a restarted
    # process and the other processes of a fleet: written with each step.
    """CREATE TABLE IF NOT EXISTS inferred (
    conv TEXT PRIMARY KEY,
    tail TEXT NOT NULL,
    protocol TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS inferred_tail ON inferred(tail)",
    # The input digest of the stateless request that ran an inferred
    # conversation's last step: a retry of it that reaches another process.
    """CREATE TABLE IF NOT EXISTS inferred_inputs (
    conv TEXT PRIMARY KEY,
    input TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS inferred_input ON inferred_inputs(input)",
)

# A step's rows in one statement (SQLite runs `executemany` a row at a time, each
# releasing the GIL; PostgreSQL, a round trip): a row at a key already written
# replaces it. 5 parameters a row stay far below either's bound on parameters.
_UPSERT = ("INSERT INTO conv_rows(conv, kind, seq, sub, data) VALUES %s "
           "ON CONFLICT(conv, kind, seq, sub) DO UPDATE SET data = excluded.data")
_ROWS_PER_STATEMENT = 500


class Stored(NamedTuple):
    """A stored conversation as start-up sees it."""

    id: str
    tenant: Optional[str]
    worker: Optional[str]
    bytes: int


class Store:
    """The conversations' rows in one SQL database: an SQLite file (one
    process, the default) or PostgreSQL (`pg.py`, shared by several).
    Safe to call from several threads."""

    now = "julianday('now')"  # the dialect's clock, for `updated_at`
    seconds_per_tick = 86400.0  # of that clock (days)

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
        self._setup(" WITHOUT ROWID")

    def _setup(self, rowid: str = "") -> None:
        self.boot = uuid.uuid4().hex  # this process: what it parks, only it reads back
        for statement in _SCHEMA:
            self._sql(statement.format(now=self.now, rowid=rowid))
        self._lock = threading.Lock()
        self._written: dict[str, Written] = {}  # conversations in memory: what the store holds of each
        self._migrate()

    failures: tuple = (sqlite3.Error,)  # what its driver raises when the store cannot be used

    def _sql(self, query: str, params: tuple = ()):
        """Run one statement (written with `?` placeholders)."""
        return self._db.execute(query, params)

    @contextmanager
    def _reading(self):
        """The store's lock, for a read. A store that cannot be read (PostgreSQL
        down or restarting, a disk error) raises StorageUnavailable: the
        routes answer it with the retryable 503, as a write that fails."""
        with self._lock:
            try:
                yield
            except self.failures as exc:
                raise StorageUnavailable(f"the store cannot be read, nothing changed: {exc}") from exc

    def describe(self) -> str:
        return f"SQLite {self.path}"

    # ----- writing --------------------------------------------------------------

    def save(self, conv: Conversation) -> int:
        """Write what changed since the conversation was last written (all of it
        the first time); returns the bytes it takes in the store. One transaction:
        on an error nothing of it is written."""
        with self._lock:
            written = self._written.get(conv.id)
            d = delta(conv, written)
            size = d.written.bytes
            self._transaction(lambda: self._write(conv, d, size, fresh=written is None))
            self._written[conv.id] = d.written
        return size

    def _fence(self, conversation_id: str) -> None:
        """Inside a transaction, before a conversation's rows change: one
        process per file here; several over PostgreSQL check ownership (pg.py)."""

    def _write(self, conv: Conversation, d, size: int, fresh: bool) -> None:
        if fresh:  # what this process has not written or read: nothing of it may stay
            self._sql("DELETE FROM conv_rows WHERE conv = ?", (conv.id,))
        for where, params in d.deletes:
            self._sql(f"DELETE FROM conv_rows WHERE conv = ? AND {where}", (conv.id, *params))
        for i in range(0, len(d.inserts), _ROWS_PER_STATEMENT):
            rows = d.inserts[i:i + _ROWS_PER_STATEMENT]
            self._sql(_UPSERT % ", ".join(["(?, ?, ?, ?, ?)"] * len(rows)),
                      tuple(v for row in rows for v in (conv.id, *row)))
        if d.head is not None:
            self._sql("INSERT INTO conv(id, tenant, worker, bytes, head, state) VALUES(?, ?, ?, ?, ?, ?) "
                      "ON CONFLICT(id) DO UPDATE SET tenant=excluded.tenant, worker=excluded.worker, "
                      "bytes=excluded.bytes, head=excluded.head, state=excluded.state, parked=NULL, "
                      f"updated_at={self.now}",
                      (conv.id, conv.tenant, conv.worker, size, d.head, d.state))
        else:
            self._sql("UPDATE conv SET worker = ?, bytes = ?, state = ?, parked = NULL, "
                      f"updated_at = {self.now} WHERE id = ?", (conv.worker, size, d.state, conv.id))
        if conv.inferred and conv.tail is not None:
            self._sql("INSERT INTO inferred(conv, tail, protocol) VALUES(?, ?, ?) "
                      "ON CONFLICT(conv) DO UPDATE SET tail = excluded.tail", (conv.id, conv.tail.hex(), conv.inferred))
        if conv.inferred and conv.retry_key is not None:
            self._sql("INSERT INTO inferred_inputs(conv, input) VALUES(?, ?) "
                      "ON CONFLICT(conv) DO UPDATE SET input = excluded.input", (conv.id, conv.retry_key.hex()))

    begin = "BEGIN IMMEDIATE"

    def _transaction(self, body) -> None:
        """Run `body()` (its statements through `_sql`) in one transaction, the store's lock held."""
        self._sql(self.begin)
        try:
            body()
        except BaseException:
            self._sql("ROLLBACK")
            raise
        self._sql("COMMIT")

    def park(self, conv: Conversation) -> None:
        """The conversation leaves memory: keep what the runtime knew of its KV
        (for this process), and forget what was written of it."""
        with self._lock:
            self._sql("UPDATE conv SET parked = ? WHERE id = ?", (parked_row(conv, self.boot), conv.id))
            self._written.pop(conv.id, None)

    def delete(self, conversation_id: str) -> None:
        with self._lock:
            def gone() -> None:
                self._fence(conversation_id)
                self._sql("DELETE FROM conv_rows WHERE conv = ?", (conversation_id,))
                self._sql("DELETE FROM inferred WHERE conv = ?", (conversation_id,))
                self._sql("DELETE FROM inferred_inputs WHERE conv = ?", (conversation_id,))
                self._sql("DELETE FROM conv WHERE id = ?", (conversation_id,))
            self._transaction(gone)
            self._written.pop(conversation_id, None)

    # ----- reading --------------------------------------------------------------

    def index(self) -> list[Stored]:
        """Every stored conversation's id, tenant, worker and bytes, least recently written first."""
        with self._reading():
            rows = self._sql("SELECT id, tenant, worker, bytes FROM conv ORDER BY updated_at").fetchall()
        return [Stored(*row) for row in rows]

    def stored(self, conversation_id: str) -> Optional[Stored]:
        """One conversation's index row (another process may have written it since start-up)."""
        with self._reading():
            row = self._sql("SELECT id, tenant, worker, bytes FROM conv WHERE id = ?", (conversation_id,)).fetchone()
        return None if row is None else Stored(*row)

    def find_tail(self, tail: bytes) -> Optional[str]:
        """The inferred conversation whose transcript has the tail digest `tail` (inference.py), if one is stored."""
        with self._reading():
            row = self._sql("SELECT conv FROM inferred WHERE tail = ?", (tail.hex(),)).fetchone()
        return None if row is None else row[0]

    def find_retry(self, input_digest: bytes) -> Optional[str]:
        """The inferred conversation whose last step a request with this input digest ran, if one is stored."""
        with self._reading():
            row = self._sql("SELECT conv FROM inferred_inputs WHERE input = ?", (input_digest.hex(),)).fetchone()
        return None if row is None else row[0]

    def inferred(self) -> list[StoredInferred]:
        """Every stored inferred conversation, with its idle time (since its last write)."""
        with self._reading():
            rows = self._sql(f"SELECT i.conv, c.tenant, i.protocol, i.tail, {self.now} - c.updated_at "
                             "FROM inferred i JOIN conv c ON c.id = i.conv").fetchall()
        return [StoredInferred(cid, tenant, protocol, bytes.fromhex(tail), float(idle) * self.seconds_per_tick)
                for cid, tenant, protocol, tail, idle in rows]

    def forget(self, conversation_id: Optional[str] = None) -> None:
        """What this process wrote of a conversation (None: of every one) may
        no longer be what the store holds: its next save writes it whole."""
        with self._lock:
            if conversation_id is None:
                self._written.clear()
            else:
                self._written.pop(conversation_id, None)

    def load(self, conversation_id: str) -> Optional[tuple[Conversation, bool]]:
        """The stored conversation (None: there is none), and whether what this
        process knew of its KV came back with it (it was parked here)."""
        with self._reading():
            row = self._sql("SELECT tenant, worker, head, state, parked FROM conv WHERE id = ?",
                            (conversation_id,)).fetchone()
            if row is None:
                return None
            rows = self._sql("SELECT kind, seq, sub, data FROM conv_rows WHERE conv = ? "
                             "ORDER BY kind, seq, sub", (conversation_id,)).fetchall()
            tenant, worker, head, state, parked = row
            conv = conversation_of(conversation_id, tenant, worker, head, state, rows)
            if conv.inferred:
                key = self._sql("SELECT input FROM inferred_inputs WHERE conv = ?", (conversation_id,)).fetchone()
                conv.retry_key = bytes.fromhex(key[0]) if key else None
            self._written[conversation_id] = written_of(conv, rows, head, state)
        return conv, unpark(conv, parked, self.boot)

    def load_all(self) -> Iterator[Conversation]:
        """Every stored conversation (tools and tests; the runtime loads lazily)."""
        for stored in self.index():
            loaded = self.load(stored.id)
            if loaded is not None:
                yield loaded[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ----- the first schema -----------------------------------------------------

    def _migrate(self) -> None:
        """A store of the first schema (`conversations`: one JSON document per
        conversation) becomes rows, in one transaction with dropping the old table."""
        with self._lock:
            columns = [r[1] for r in self._db.execute("PRAGMA table_info(conversations)")]
            if "data" not in columns:
                return
            old = self._db.execute("SELECT data FROM conversations ORDER BY updated_at").fetchall()

            def move() -> None:
                for (text,) in old:
                    conv = legacy_conversation(text)
                    d = delta(conv, None)
                    self._write(conv, d, d.written.bytes, fresh=True)
                self._sql("DROP TABLE conversations")
            self._transaction(move)


class Unstored:
    """No store (no `--data-dir`): the bytes each conversation would take in
    one, kept the same way, step by step (the per-tenant byte budget)."""

    def __init__(self) -> None:
        self._written: dict[str, Written] = {}

    def save(self, conv: Conversation) -> int:
        d = delta(conv, self._written.get(conv.id))
        self._written[conv.id] = d.written
        return d.written.bytes

    def delete(self, conversation_id: str) -> None:
        self._written.pop(conversation_id, None)
