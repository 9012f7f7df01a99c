"""Values computed from objects that are never changed in place, kept for as
long as the object lives, found by its identity.

A conversation's history is such objects (messages are replaced, never
edited), and so is what is derived from them on the way out to a provider:
the wire form of a message, its parse, its stripped form, its rendering, its
token counts. Memoizing those by identity makes a step's outbound work cost
one lookup per message of the history instead of a parse and a render, and
holds nothing past the objects' own lives: an entry leaves when its key dies
(a weak reference's callback), so a memo never keeps a conversation that left
memory, and objects that cannot be weakly referenced (plain dicts from a
client's body) are simply not memoized.

Thread-safe in the sense that matters here: dict operations are atomic under
the GIL, and a race computes a value twice, never a wrong one.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class WeakMemo:
    """`compute(obj)` by the identity of `obj`, for as long as `obj` lives.
    The value must not refer to `obj` (it would keep it alive)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, obj: Any, compute: Callable[[Any], T]) -> T:
        key = id(obj)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is obj:
            return hit[1]
        value = compute(obj)
        try:
            ref = weakref.ref(obj, self._forget(key))
        except TypeError:  # not weakly referenceable: not memoized
            return value
        self._entries[key] = (ref, value)
        return value

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        entries = self._entries

        def forget(ref: weakref.ref) -> None:
            hit = entries.get(key)
            if hit is not None and hit[0] is ref:  # not an entry a new object took since
                del entries[key]
        return forget

    def __len__(self) -> int:
        return len(self._entries)


class WireMessage(dict):
    """A message's wire form built from a stored message: a dict (it is sent
    as it is) that, unlike a client's, lives as long as the stored message
    and can be memoized by identity downstream (`WeakMemo`). Never changed
    after it is built."""

    __slots__ = ("__weakref__",)
