"""A memo bounded by bytes, not entries: a few huge inputs (a 10 MB message
that is then refused) cannot pin memory, and small ones are kept by the
thousand. Least recently used first out; thread-safe."""

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
