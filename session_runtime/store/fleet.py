"""Several runtime processes over one PostgreSQL store: which one serves a
conversation.

- **Members.** Each process (`serve --store postgresql://...`) registers its
  id and the URL the others reach it at in the table `members` and beats
  every `ttl/3` seconds; a member whose beat is older than `ttl` is gone.
- **One owner.** A conversation is served by one member at a time, its
  `owner` in `conv`. A member serves only conversations it owns: a request
  for another's is forwarded to it (api/forward.py), never served twice. The
  store fences every write: a step's rows are written only while its writer
  owns the conversation, checked in the step's own transaction
  (pg.py), so a member that stalled past its beat cannot acknowledge a
  step another member has taken over.
- **Placement.** The workers' placement (placement.py: consistent hashing
  of the conversation id with bounded loads) over the live members, each
  member's load its owned conversations as of the last beat: a new
  conversation's id is drawn until this member is its first choice (it is
  created here whatever the draw: conversations spread as requests do); a
  conversation whose owner is gone goes to its first choice among the live
  members, which claims it, reads it from the store and rebuilds its KV by
  prefill (counted as `backend_lost`, as after a restart).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from session_runtime.errors import StorageUnavailable
from session_runtime.placement import place, ring
from session_runtime.store.pg import connect

log = logging.getLogger("session_runtime.store.fleet")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS members (id TEXT PRIMARY KEY, url TEXT NOT NULL, beat DOUBLE PRECISION NOT NULL)",
    "ALTER TABLE conv ADD COLUMN IF NOT EXISTS owner TEXT",
    "CREATE INDEX IF NOT EXISTS conv_owner ON conv(owner)",
)
NOW = "extract(epoch from clock_timestamp())"


@dataclass(frozen=True)
class Route:
    """Where a request for a conversation goes: here (`url` None), or to the
    member at `url`. `claimed`: this member just took the conversation over,
    so what it held of it in memory is stale."""

    owner: str
    url: Optional[str] = None
    claimed: bool = False


class Fleet:
    def __init__(self, url: str, advertise: str, ttl: float = 3.0, member: Optional[str] = None,
                 epsilon: float = 0.25):
        self.id = member or uuid.uuid4().hex[:12]
        self.advertise, self.ttl, self.epsilon = advertise, ttl, epsilon
        self._loads: dict[str, int] = {}
        self._ring: tuple[tuple, list] = ((), [])  # (members, their hash ring)
        self.url = url
        self._db = connect(url)
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.on_lost: Callable[[], None] = lambda: None  # this member's beat lapsed: what it holds may be stale
        # Conversations this member found it owns since its beats last lapsed: routed
        # here without asking the store (no one takes a live member's conversations).
        self._mine: set[str] = set()
        for statement in _SCHEMA:
            self._sql(statement)
        self._beat()

    def _sql(self, query: str, params: tuple = ()):
        """Raises StorageUnavailable (the routes' retryable 503) while the store
        cannot be reached."""
        import psycopg

        with self._lock:
            try:
                if self._db.broken or self._db.closed:  # the server restarted, or dropped us
                    self._db = connect(self.url)
                return self._db.execute(query, params)
            except psycopg.OperationalError as exc:
                raise StorageUnavailable(f"the store cannot be reached, nothing changed: {exc}") from exc

    # ----- membership -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beating, name="fleet-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        sent = time.monotonic()  # no later than the beat the store records: the others see it lapse after we do
        self._sql(f"INSERT INTO members(id, url, beat) VALUES(%s, %s, {NOW}) ON CONFLICT(id) DO UPDATE "
                  f"SET url = excluded.url, beat = {NOW}", (self.id, self.advertise))
        rows = self._sql(f"SELECT id, url FROM members WHERE beat > {NOW} - %s", (self.ttl,)).fetchall()
        owned = dict(self._sql("SELECT owner, count(*) FROM conv WHERE owner IS NOT NULL GROUP BY owner").fetchall())
        self._live = dict(rows)
        self._loads = {m: owned.get(m, 0) for m in self._live}
        members = tuple(sorted(self._live))
        if members != self._ring[0]:
            self._ring = (members, ring(members))
        self._beaten = sent

    def _beating(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            lapsed = time.monotonic() - self._beaten > self.ttl
            try:
                self._beat()
            except Exception as exc:  # the store is away: keep trying; fenced writes keep it safe
                log.warning("fleet: cannot beat (%s)", exc)
                continue
            if lapsed:
                log.warning("fleet: this member's beat lapsed; conversations in memory are read again")
                self._mine.clear()
                self.on_lost()

    def unreachable(self, member: str) -> None:
        """A relay to `member` was refused: nothing listens at its address, so
        its process is gone, whatever its last beat says. Its row goes now, so
        that every member (and the claim's own check) sees it gone at once
        rather than after its beat's TTL, and its conversations are taken over
        at their next requests. A member that lives after all beats back in;
        its writes stay fenced, so nothing is served twice."""
        if member == self.id:
            return
        self._sql("DELETE FROM members WHERE id = %s", (member,))
        log.warning("fleet: member %s refused a relayed request; its conversations are taken over now", member)
        self._beat()

    def live(self) -> dict[str, str]:
        """{member id: URL} of the live members, as of the last beat."""
        return dict(self._live)

    def close(self) -> None:
        """Leave the fleet: the others take this member's conversations over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._sql("DELETE FROM members WHERE id = %s", (self.id,))
        finally:
            self._db.close()

    # ----- placement ------------------------------------------------------------

    def first_choice(self, cid: str, live: Optional[dict] = None) -> str:
        members = live if live is not None else self._live
        if not members:
            return self.id
        loads = {m: self._loads.get(m, 0) for m in members}
        known, points = self._ring
        return place(cid, loads, self.epsilon, points if set(known) == set(loads) else None)

    def new_id(self, draw: Callable[[], str]) -> str:
        """An id drawn until this member is its first choice (a few draws: one
        per live member on average)."""
        for _ in range(64 * max(1, len(self._live))):
            cid = draw()
            if self.first_choice(cid) == self.id:
                return cid
        return cid

    def owned(self, cid: str) -> Optional[Route]:
        """Here, without asking the store, for a conversation this member found
        it owns, while its beats hold (no member takes a live one's
        conversations; a write checks it again: pg.py `_fence`). Else None."""
        if cid in self._mine and time.monotonic() - self._beaten < self.ttl:
            return Route(self.id)
        return None

    def forget(self, cid: str) -> None:
        """`cid` was deleted."""
        self._mine.discard(cid)

    def route(self, cid: str, relayed: bool = False) -> Route:
        """Where a request for `cid` is served; claims it for this member when
        its owner is gone and this member is its first choice, or when the
        request was relayed here by a member that found this one its first
        choice (members' views of who is live may differ for a moment)."""
        mine = self.owned(cid)
        if mine is not None:
            return mine
        for _ in range(3):
            row = self._sql("SELECT owner FROM conv WHERE id = %s", (cid,)).fetchone()
            live = self.live()
            owner = row[0] if row is not None else None
            if owner == self.id:
                self._mine.add(cid)
                return Route(self.id)
            if owner is not None and owner in live:
                return Route(owner, live[owner])
            choice = self.id if relayed else self.first_choice(cid, live)
            if choice != self.id:  # unknown here, or orphaned: its first choice answers (and claims it)
                return Route(choice, live[choice])
            if row is None:  # no such conversation (yet): served here, a create makes it ours
                return Route(self.id)
            taken = self._sql(
                f"UPDATE conv SET owner = %s WHERE id = %s AND (owner IS NULL OR owner = %s OR owner NOT IN "
                f"(SELECT id FROM members WHERE beat > {NOW} - %s))", (self.id, cid, self.id, self.ttl))
            if taken.rowcount == 1:
                log.info("fleet: %s took conversation %s over from %s", self.id, cid, owner)
                self._mine.add(cid)
                return Route(self.id, claimed=True)
            self._beat()  # another member claimed it first: look again
        raise RuntimeError(f"conversation {cid!r}: no member could take it over")
