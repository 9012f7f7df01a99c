"""A memo bounded by bytes, not entries: a few huge inputs (a 10 MB message
that is then refused) cannot pin memory, and small ones are kept by the
thousand. Least recently used first out; thread-safe.

`IdentityMemo` is the same keyed by an object's identity, for values derived
from objects never changed in place (a message, a tools list): the object is
kept alive beside its value, so its id is not reused while the entry lives.
(weak_memo.py keeps values only as long as their objects live instead, for
objects that can be weakly referenced.)"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Optional, TypeVar

V = TypeVar("V")


class BytesLRU(Generic[V]):
    def __init__(self, max_bytes: int, size: Callable[[Hashable, V], int]):
        self.max_bytes = max_bytes
        self._size = size
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Optional[V]:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def get_or_compute(self, key: Hashable, compute: Callable[[], V]) -> V:
        hit = self.get(key)
        if hit is not None:
            return hit
        value = compute()  # outside the lock: another thread may compute the same, harmlessly
        self.put(key, value)
        return value

    def put(self, key: Hashable, value: V) -> None:
        """Keep `value` (a first one stays); one too big to keep (over an eighth
        of the bound: it would push out hundreds of others) is not kept."""
        nbytes = self._size(key, value)
        if nbytes > self.max_bytes // 8:
            return
        with self._lock:
            if key not in self._items:
                self._items[key] = (value, nbytes)
                self._bytes += nbytes
                while self._bytes > self.max_bytes:
                    _, (_, freed) = self._items.popitem(last=False)
                    self._bytes -= freed

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)


class IdentityMemo(Generic[V]):
    """`compute(obj)` by the identity of `obj`, within `max_bytes` as
    `size(obj, value)` counts them."""

    def __init__(self, max_bytes: int, size: Callable[[object, V], int]):
        self._lru: BytesLRU[tuple[object, V]] = BytesLRU(max_bytes, lambda key, hit: size(hit[0], hit[1]))

    def get(self, obj: object, compute: Callable[[object], V]) -> V:
        hit = self._lru.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        value = compute(obj)
        self._lru.put(id(obj), (obj, value))  # the object kept alive: its id is not reused meanwhile
        return value

    def __len__(self) -> int:
        return len(self._lru)
