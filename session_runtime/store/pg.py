"""The conversation store in PostgreSQL: `serve --store postgresql://...`.

The same rows and the same one-transaction-per-step writes as the SQLite
store (sqlite.py), over one connection per runtime process, in autocommit mode
with explicit transactions (`BEGIN ... COMMIT`), so that a step's rows are
durable when its response returns (PostgreSQL's default `synchronous_commit`).
A transaction's statements are pipelined (libpq's pipeline mode): a step's
write is one round trip, two in a fleet (the owner's check is read first),
where each statement was one, all of them under the store's lock.
Several runtime processes may share one database; each writes only the
conversations it serves.
"""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

from session_runtime.errors import InvalidRequest
from session_runtime.store.sqlite import Store

SCHEMES = ("postgresql", "postgres")
_SCHEMA_LOCK = 0x5E55_1011  # an advisory lock's key: creating the tables


def check_url(url: str) -> str:
    """The URL as given, or InvalidRequest naming what is wrong with it."""
    if urlsplit(url).scheme not in SCHEMES:  # the CLI checks it the same way, before importing this
        raise InvalidRequest(f"--store takes a PostgreSQL URL (postgresql://user@host:port/database), got {url!r}")
    return url


class NotOwner(Exception):
    """Another runtime process serves this conversation now (fleet.py)."""


class PgStore(Store):
    now = "extract(epoch from clock_timestamp())"
    seconds_per_tick = 1.0
    begin = "BEGIN"
    member: Optional[str] = None  # in a fleet (fleet.py): this process; its writes are fenced
    _pipelined = False  # inside a transaction's pipeline (the store's lock held)

    def __init__(self, url: str):
        import psycopg

        self.url = check_url(url)
        self.failures = (psycopg.Error,)
        try:
            self._db = connect(url)
        except psycopg.Error as exc:
            raise InvalidRequest(f"cannot connect to the store at {_safe(url)}: {str(exc).strip()}") from None
        # Two processes starting at once must not both create the tables.
        self._db.execute("SELECT pg_advisory_lock(%s)", (_SCHEMA_LOCK,))
        try:
            self._setup()
        finally:
            self._db.execute("SELECT pg_advisory_unlock(%s)", (_SCHEMA_LOCK,))

    def _reconnected(self) -> bool:
        """A new connection when the server restarted, or dropped us (a transaction
        that was open failed with the old one). Whether one was made."""
        if not (self._db.broken or self._db.closed):
            return False
        self._db = connect(self.url)
        return True

    def _sql(self, query: str, params: tuple = ()):
        if self._reconnected() and query == "ROLLBACK":  # its transaction went with the old connection
            return None
        # Not prepared inside a pipeline: psycopg 3.3 forgets its prepared statements on a ROLLBACK's
        # result and deallocates them later in the pipeline, where the next transaction's were made
        # (measured: "prepared statement _pg3_9 does not exist" after a rolled-back write).
        return self._db.execute(query.replace("?", "%s"), params, prepare=not self._pipelined)

    def _transaction(self, body) -> None:
        """The transaction's statements sent without waiting for each answer; a
        read (the fence's) waits for what was sent before it. A statement that
        fails raises at the pipeline's end, where the server skipped the rest
        (COMMIT too); the transaction is rolled back after the pipeline, as
        is one whose body raised."""
        from psycopg.pq import TransactionStatus

        self._reconnected()
        db = self._db
        try:
            with db.pipeline():
                self._pipelined = True
                self._sql(self.begin)
                body()
                self._sql("COMMIT")
        except BaseException:
            if not db.broken and not db.closed and db.info.transaction_status != TransactionStatus.IDLE:
                db.execute("ROLLBACK")
            raise
        finally:
            self._pipelined = False

    def _fence(self, conversation_id: str) -> None:
        """In a fleet, a conversation's rows are written (or deleted) only by its
        owner: the owner is read and its row locked in the step's transaction, so
        a member that lost the conversation (its beat lapsed, another took it
        over) cannot write, and a claim waits for a write under way."""
        if self.member is not None:
            row = self._sql("SELECT owner FROM conv WHERE id = ? FOR UPDATE", (conversation_id,)).fetchone()
            if row is not None and row[0] not in (None, self.member):
                raise NotOwner(f"conversation {conversation_id!r} is served by runtime process {row[0]} now; retry")

    def _write(self, conv, d, size: int, fresh: bool) -> None:
        self._fence(conv.id)
        super()._write(conv, d, size, fresh)
        if self.member is not None:
            self._sql("UPDATE conv SET owner = ? WHERE id = ? AND owner IS NULL", (self.member, conv.id))

    def _migrate(self) -> None:
        """A PostgreSQL store has only ever had rows."""

    def describe(self) -> str:
        return f"PostgreSQL {_safe(self.url)}"


def connect(url: str):
    """An autocommit connection (transactions are explicit) that gives up
    connecting after 10 s, and finds a dead peer by TCP keepalives."""
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=10, keepalives_idle=30)


def _safe(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
