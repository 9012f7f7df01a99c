"""The conversations a runtime serves: every one it knows by id and tenant,
and in memory only the recently used ones.

A stored conversation is known from start-up (the store's index: id, tenant)
and read from the store at its first use (`get`); past the runtime's bound
(`--max-resident-conversations`) the least recently used ones that nothing is
using leave memory again (persistence.Persistence.evict_idle). Every call runs under the
table's lock (conversation_table.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Callable, Iterator, Optional

from session_runtime.conversation import Conversation


class Conversations(Mapping):
    """A mapping of every known conversation id to its conversation, loaded on first use."""

    def __init__(self, load: Callable[[str], Optional[Conversation]]):
        self._load = load
        self._resident: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        self._tenants: dict[str, Optional[str]] = {}
        self._counts: Counter = Counter()

    # ----- the mapping: every known conversation --------------------------------

    def __getitem__(self, cid: str) -> Conversation:
        conv = self.get(cid)
        if conv is None:
            raise KeyError(cid)
        return conv

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tenants))

    def __len__(self) -> int:
        return len(self._tenants)

    def __contains__(self, cid) -> bool:
        return cid in self._tenants

    def get(self, cid: str, default=None):
        """The conversation, read from the store if it is not in memory."""
        conv = self._resident.get(cid)
        if conv is not None:
            self._resident.move_to_end(cid)
            return conv
        if cid not in self._tenants:
            return default
        conv = self._load(cid)
        if conv is None:
            return default
        self._resident[cid] = conv
        return conv

    # ----- known and resident ----------------------------------------------------

    def know(self, cid: str, tenant: Optional[str]) -> None:
        """A stored conversation, not read yet."""
        if cid not in self._tenants:
            self._tenants[cid] = tenant
            self._counts[tenant] += 1

    def add(self, conv: Conversation) -> None:
        self.know(conv.id, conv.tenant)
        self._resident[conv.id] = conv

    def pop(self, cid: str, default=None):
        if cid in self._tenants:
            self._counts[self._tenants.pop(cid)] -= 1
        return self._resident.pop(cid, default)

    def drop_resident(self, cid: Optional[str] = None) -> None:
        """Forget what memory holds of a conversation (None: of all): it is
        read from the store again at its next use."""
        if cid is None:
            self._resident.clear()
        else:
            self._resident.pop(cid, None)

    def peek(self, cid: str) -> Optional[Conversation]:
        """The conversation if it is in memory, without reading it or marking it used."""
        return self._resident.get(cid)

    def unload(self, cid: str) -> None:
        """It leaves memory; it stays known (its next use reads it back)."""
        self._resident.pop(cid, None)

    def least_recent(self) -> list[Conversation]:
        """The conversations in memory, least recently used first."""
        return list(self._resident.values())

    @property
    def resident(self) -> int:
        return len(self._resident)

    def count_of(self, tenant: Optional[str]) -> int:
        return self._counts[tenant]

    def ids_of(self, tenant: Optional[str]) -> set[str]:
        return {cid for cid, t in self._tenants.items() if t == tenant}
