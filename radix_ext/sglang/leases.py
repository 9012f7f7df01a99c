"""Chains held under a lease, so that a runtime that is gone cannot leak them.

Each chain is held for a holder (one runtime process, a random id it sends
with its steps) under that holder's lease: every step that holds a chain and
the holder's heartbeat (`renew`) push its deadline on; once a holder's
deadline passes, the scheduler returns all of its chains to the LRU (their
pages become evictable; nothing else is lost: the conversations live in the
runtime). A chain held without a holder or with lease 0 has no deadline (the
old behaviour: only its runtime releases it). `adopt` hands the chains a
restarted runtime knows to its new holder and releases the rest, except
those another runtime holds under a live lease (several runtimes may share
a server).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional


class Leases:
    def __init__(self) -> None:
        self.holder_of: dict[str, str] = {}  # owner -> holder
        self.until: dict[str, float] = {}  # holder -> monotonic deadline
        self.expired_chains = 0

    def hold(self, owner: str, holder: Optional[str], lease_s: float, now: Optional[float] = None) -> None:
        if not holder or lease_s <= 0:
            self.holder_of.pop(owner, None)
            return
        self.holder_of[owner] = holder
        self._push(holder, lease_s, now)

    def renew(self, holder: str, lease_s: float, now: Optional[float] = None) -> int:
        """Push the holder's deadline to `lease_s` from now; its chain count (the
        heartbeat's answer: counted here, not on every step's hold)."""
        self._push(holder, lease_s, now)
        return sum(1 for h in self.holder_of.values() if h == holder)

    def _push(self, holder: str, lease_s: float, now: Optional[float]) -> None:
        now = time.monotonic() if now is None else now
        self.until[holder] = max(self.until.get(holder, 0.0), now + lease_s)

    def live(self, owner: str, now: Optional[float] = None) -> bool:
        """Is the chain held under a lease that has not passed (another runtime's, maybe)?"""
        holder = self.holder_of.get(owner)
        now = time.monotonic() if now is None else now
        return holder is not None and self.until.get(holder, 0.0) >= now

    def forget(self, owner: str) -> None:
        self.holder_of.pop(owner, None)

    def adopt(self, holder: str, lease_s: float, owners: Iterable[str], now: Optional[float] = None) -> None:
        for owner in owners:
            self.hold(owner, holder, lease_s, now)

    def expired(self, now: Optional[float] = None) -> list[str]:
        """Owners whose holder's lease has passed (their holders are dropped)."""
        now = time.monotonic() if now is None else now
        gone = {h for h, t in self.until.items() if t < now}
        if not gone:
            return []
        for h in gone:
            del self.until[h]
        owners = [o for o, h in self.holder_of.items() if h in gone]
        for o in owners:
            del self.holder_of[o]
        self.expired_chains += len(owners)
        return owners

    def clear(self) -> None:
        self.holder_of.clear()
        self.until.clear()
