"""The runtime's conversations as the store holds them: opening the store
(SQLite, or PostgreSQL with a fleet of processes over it), the index read at
start, a conversation read at its first use and parked when it leaves memory,
each step's write and the per-tenant byte totals it keeps, and what a fleet
member does when it serves a conversation another process created or owned.

Also where its record says it lives: its worker (placed at creation and at
load, moved off a drained one, which its record then says lost its KV), and
its canonical branch once built.

The runtime's part for it (runtime.py builds it), handed what it uses: the
config, the backend, the conversations and their locks (conversation_table.py),
the session index and the materializer (whose jobs keep a conversation in
memory).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Optional

from session_runtime.conversation import Conversation
from session_runtime.errors import BackendUnavailable, OwnedElsewhere, WorkerNotFound
from session_runtime.store.sqlite import Store, Stored, Unstored

log = logging.getLogger("session_runtime.runtime")


class Persistence:
    """Opens the store: only the index is read; a conversation is read at its
    first use (`load`, the table's loader). `table`: the runtime's
    ConversationTable (runtime/conversation_table.py), which sits above the
    store and is handed in, never imported here."""

    def __init__(self, config, backend, table, sessions, materializer):
        self.config, self.backend, self.table = config, backend, table
        self.sessions, self.materializer = sessions, materializer
        self.conversations = table.registry
        self.store: Optional[Store] = None
        self.fleet = None  # several processes over one PostgreSQL store (fleet.py)
        self.unstored = Unstored()  # without a store: the bytes each conversation would take in one
        if self.config.store:
            from session_runtime.store.pg import PgStore

            self.store = PgStore(self.config.store)
            if self.config.advertise_url:
                from session_runtime.store.fleet import Fleet

                self.fleet = Fleet(self.config.store, self.config.advertise_url, self.config.member_ttl_s)
                self.store.member = self.fleet.id
                self.fleet.on_lost = self._forget_resident
        elif self.config.data_dir:
            self.store = Store(Path(self.config.data_dir) / "conversations.sqlite3")
        for stored in self.store.index() if self.store is not None else ():
            self._know(stored)
        if self.store is not None and self.fleet is None:  # a fleet's members each sweep what they serve
            self.sessions.seed(self.store.inferred())
        # Chains of conversations it does not know are released; in a fleet the
        # others' chains are theirs (a dead one's go back to the LRU after its lease).
        self.backend.adopt(sorted(self.conversations) if self.fleet is None else [],
                           release_others=self.fleet is None)
        if self.fleet is not None:
            self.fleet.start()

    def _know(self, stored: Stored) -> None:
        """A stored conversation, not read yet."""
        self.table.know(stored.id, stored.tenant, stored.bytes)

    def take(self, cid: str, claimed: bool) -> None:
        """In a fleet, a request for `cid` is served here: a conversation another
        process created since start-up becomes known; one this process just took
        over is read from the store again, its KV here is released (the next
        step prefills what the other process had computed: `backend_lost`)."""
        with self.table.lock:
            if claimed:
                self.conversations.drop_resident(cid)
                self.store.forget(cid)
            known = cid in self.conversations
        if claimed:
            self.backend.release(cid)
        if not known:
            stored = self.store.stored(cid)
            if stored is not None:
                self._know(stored)

    def serve_here(self, cid: str) -> None:
        """In a fleet, before a stateless request steps `cid` (found by its
        history, not named in the request, so api/forward.py could not route
        it): raises OwnedElsewhere when another live process owns it, which the
        relay turns into the request's relay to that process; else makes it
        served here, as the relay does for a named conversation."""
        if self.fleet is None:
            return
        route = self.fleet.owned(cid) or self.fleet.route(cid)
        if route.url is not None:
            raise OwnedElsewhere(cid, route.owner, route.url)
        if route.claimed or cid not in self.conversations:
            self.take(cid, route.claimed)

    def _forget_resident(self) -> None:
        """This process's beat lapsed: another may have served its conversations since."""
        with self.table.lock:
            self.conversations.drop_resident()
            self.store.forget()

    def load(self, cid: str) -> Optional[Conversation]:
        """A stored conversation's first use since start-up, or since it left
        memory (the table's loader, called under its lock)."""
        loaded = self.store.load(cid) if self.store is not None else None
        if loaded is None:
            return None
        conv, parked = loaded
        if not parked:  # the KV its steps computed went with the process that ran them
            conv.known = conv.restored_known()
        self.place(conv, conv.worker)
        return conv

    def evict_idle(self) -> None:
        """Past --max-resident-conversations, the least recently used
        conversations that no request and no canonical branch is using leave
        memory; what the runtime knew of their KV is parked in the store (their
        chains stay where they are). Nothing is lost: the next use reads them back."""
        bound = self.config.max_resident_conversations
        if self.store is None or not bound:
            return
        with self.table.lock:
            excess = self.conversations.resident - bound
            for conv in self.conversations.least_recent():
                if excess <= 0:
                    return
                lock = self.table.lock_of(conv.id)
                if lock is None or conv.id in self.materializer.jobs or not lock.acquire(blocking=False):
                    continue
                try:
                    self.store.park(conv)
                    self.conversations.unload(conv.id)
                    excess -= 1
                except Exception:  # kept in memory: nothing is lost
                    log.warning("conversation %s could not be parked; it stays in memory", conv.id, exc_info=True)
                finally:
                    lock.release()

    def new_id(self) -> str:
        draw = lambda: uuid.uuid4().hex[:16]  # noqa: E731
        return draw() if self.fleet is None else self.fleet.new_id(draw)

    def persist(self, conv: Conversation) -> None:
        conv.worker = self.backend.worker_of(conv.id) or conv.worker  # a step may have moved it
        if conv.inferred and self.store is not None:
            conv.tail = self.sessions.tail_of(conv)
        self.table.sized(conv.id, conv.tenant, (self.store or self.unstored).save(conv))

    def place(self, conv: Conversation, worker: Optional[str] = None, stateless: bool = False) -> None:
        """Many workers: the conversation's worker (a restored one while it is
        usable; a stateless one's, none while sglang-router routes its steps).
        None is up: placed at its first step instead."""
        try:
            conv.worker = self.backend.place(conv.id, worker, stateless=stateless)
        except BackendUnavailable:
            conv.worker = worker

    def drain(self, worker: str) -> list[str]:
        """Many workers: nothing more is placed on `worker`, and its conversations
        move to the others now (their next steps prefill there). Returns the
        conversations moved. Raises WorkerNotFound."""
        if worker not in getattr(self.backend, "workers", {}):
            raise WorkerNotFound(worker)
        moved = self.backend.drain(worker)
        for cid in moved:
            with self.table.lock:
                conv, lock = self.conversations.get(cid), self.table.lock_of(cid)
            if conv is not None and lock is not None and lock.acquire(blocking=False):
                try:  # a step under way persists the new placement itself (and sees the move)
                    if self.conversations.peek(cid) is not conv:
                        continue  # it left memory meanwhile: its next use reads the placement back
                    conv.known = dataclasses.replace(conv.known, lost="backend_lost")
                    self.persist(conv)
                finally:
                    lock.release()
        return moved

    def materialized(self, job) -> None:
        """A canonical branch is in the tree: record it on the turn that closed.
        Runs on the materializer's thread; the conversation's next step waits
        for the job, so nothing else writes these fields meanwhile."""
        with self.table.lock:
            conv = self.conversations.get(job.owner)
        if conv is not None and conv.turns:
            conv.turns[-1].canonical_built(job.prefill_tokens)
            conv.canonical_kind = "canonical"
            self.persist(conv)
