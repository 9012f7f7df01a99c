"""A node's children with their first pages kept sorted, for the logical probe.

The tree's logical probe (`SessionRadixCache.probe`) asks, where a prompt
leaves the tree inside a page, how many tokens of that page some child still
shares: the reusable prefix the accounting reports past the page-aligned
match. Scanning every child for it costs O(children) per probe, and the node
where many conversations part (one system prompt, thousands of users) has
thousands of children: measured on SGLang's scheduler, that scan was 8% of
its time at one agent (bench/sglang_server.py, forced steps).

`IndexedChildren` is SGLang's children dict (first-page key -> child) that
also keeps, per namespace, the first pages in sorted order. Among sorted
strings the longest common prefix with a query is held by one of the query's
two neighbours, so the probe bisects instead of scanning. SGLang's tree
changes a node's children only by item assignment and `pop` (`_insert_helper`,
`_split_node`, `_delete_leaf`), which this class sees; the probe converts a
node's plain dict the first time it looks at it (`indexed`), so the index is
exact from then on.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Hashable

_MISSING = object()


def _split(child_key: Hashable) -> tuple[Hashable, tuple]:
    """(namespace, first page) of a child key as SGLang's RadixKey.child_key_at
    makes it: the page alone, (extra_key, page) or ((extra_key, cache_salt), page);
    a page of one token is the token itself."""
    if isinstance(child_key, tuple) and len(child_key) == 2 and not isinstance(child_key[0], int):
        ns, page = child_key
    else:
        ns, page = None, child_key
    return ns, (page if isinstance(page, tuple) else (page,))


def namespace_of(extra_key: Any, cache_salt: Any) -> Hashable:
    """The namespace part of the child keys of a RadixKey with these fields."""
    if cache_salt is not None:
        return (extra_key, cache_salt)
    return extra_key


def _lcp(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class IndexedChildren(dict):
    """dict of child key -> child node, with each namespace's first pages sorted."""

    __slots__ = ("_pages",)

    def __init__(self, items: Any = ()):
        super().__init__(items)
        self._pages: dict[Hashable, list[tuple]] = {}
        for key in dict.keys(self):
            self._add(key)

    def _add(self, key: Hashable) -> None:
        ns, page = _split(key)
        insort(self._pages.setdefault(ns, []), page)

    def _remove(self, key: Hashable) -> None:
        ns, page = _split(key)
        pages = self._pages[ns]
        del pages[bisect_left(pages, page)]
        if not pages:
            del self._pages[ns]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        if key not in self:
            self._add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        self._remove(key)

    def pop(self, key: Hashable, default: Any = _MISSING) -> Any:
        if key in self:
            self._remove(key)
            return super().pop(key)
        if default is _MISSING:
            raise KeyError(key)
        return default

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def popitem(self) -> tuple:
        key, value = super().popitem()
        self._remove(key)
        return key, value

    def clear(self) -> None:
        super().clear()
        self._pages.clear()

    def longest_partial(self, ns: Hashable, page: tuple) -> int:
        """The most leading tokens of `page` (at most one page) that a child of
        namespace `ns` begins with."""
        pages = self._pages.get(ns)
        if not pages:
            return 0
        i = bisect_left(pages, page)
        return max((_lcp(pages[j], page) for j in (i - 1, i) if 0 <= j < len(pages)), default=0)


def indexed(node: Any) -> IndexedChildren:
    """`node.children`, made an IndexedChildren the first time (in place)."""
    children = node.children
    if type(children) is not IndexedChildren:
        children = node.children = IndexedChildren(children)
    return children
