"""The runtime's conversations and their locks (core.py's part): the
registry of every conversation it knows (store/registry.py: read at first use), one
lock per conversation that its steps hold, the runtime's lock over all of it,
and each conversation's stored bytes summed per tenant (their budget).

Every other part that needs a conversation goes through here: `locked` holds
a conversation's lock and hands it over only while it is still the one in
memory (a delete that ran first wins; one that left memory meanwhile is read
back)."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

from session_runtime.conversation import Conversation
from session_runtime.errors import ConversationBusy, ConversationNotFound, TooManyConversations
from session_runtime.store.registry import Conversations


class ConversationTable:
    """`load(cid)`: a stored conversation read at its first use (None: unknown);
    `on_loaded()`: called after a read brought one into memory (the storage
    then sends the least recently used ones out past its bound)."""

    def __init__(self, load: Callable[[str], Optional[Conversation]]):
        self.registry = Conversations(load)
        self.lock = threading.RLock()
        self.on_loaded: Callable[[], None] = lambda: None
        self._locks: dict[str, threading.Lock] = {}
        self._sizes: dict[str, int] = {}  # bytes each conversation takes as stored (estimated without a store)
        self._tenant_bytes: dict[Optional[str], int] = {}

    def get(self, cid: str) -> Conversation:
        """Raises ConversationNotFound."""
        with self.lock:
            resident = self.registry.resident
            conv = self.registry.get(cid)
            loaded = self.registry.resident > resident
        if conv is None:
            raise ConversationNotFound(cid)
        if loaded:
            self.on_loaded()
        return conv

    @contextlib.contextmanager
    def locked(self, cid: str) -> Iterator[Conversation]:
        """Hold the conversation's lock; raises ConversationNotFound if it is gone
        by the time the lock is ours (a delete that ran first wins)."""
        while True:
            conv = self.get(cid)
            with self.lock:
                lock = self._locks.get(conv.id)
            if lock is None:
                raise ConversationNotFound(cid)
            with lock:
                with self.lock:
                    current = self.registry.peek(conv.id)
                if current is conv:
                    yield conv
                    return
                if cid not in self.registry:
                    raise ConversationNotFound(cid)
            # It left memory while we waited (the storage's bound): read it back.

    def lock_of(self, cid: str) -> Optional[threading.Lock]:
        with self.lock:
            return self._locks.get(cid)

    def know(self, cid: str, tenant: Optional[str], size: int) -> None:
        """A stored conversation, not read yet."""
        with self.lock:
            if cid not in self.registry:
                self.registry.know(cid, tenant)
                self._locks[cid] = threading.Lock()
                self.sized(cid, tenant, size)

    def add(self, conv: Conversation, limit: int) -> None:
        """A new conversation. Raises ConversationBusy when its id is taken,
        TooManyConversations when its tenant has `limit` (0: no limit)."""
        with self.lock:
            if conv.id in self.registry:
                raise ConversationBusy(f"conversation {conv.id!r} already exists")
            if limit and self.registry.count_of(conv.tenant) >= limit:
                raise TooManyConversations(f"the tenant has {limit} conversations, the most this server keeps "
                                           "(--max-conversations-per-tenant): delete some first")
            self.registry.add(conv)
            self._locks[conv.id] = threading.Lock()

    def remove(self, conv: Conversation) -> None:
        """Forget it, and its stored bytes."""
        with self.lock:
            self.registry.pop(conv.id, None)
            self._locks.pop(conv.id, None)
        self.sized(conv.id, conv.tenant, None)

    def sized(self, cid: str, tenant: Optional[str], size: Optional[int]) -> None:
        """Record a conversation's stored bytes (None: it is gone) in its tenant's total."""
        with self.lock:
            old = self._sizes.pop(cid, 0)
            if size is not None:
                self._sizes[cid] = size
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) - old + (size or 0)

    def held(self, tenant: Optional[str]) -> int:
        """The bytes the tenant's conversations hold as stored."""
        with self.lock:
            return self._tenant_bytes.get(tenant, 0)

    def size_of(self, cid: str) -> int:
        with self.lock:
            return self._sizes.get(cid, 0)
