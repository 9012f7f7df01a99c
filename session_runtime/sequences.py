"""Where two sequences part, compared in C: a step compares whole token
sequences and message lists, so no Python loop walks them."""

from __future__ import annotations

import operator
from itertools import compress, count
from typing import Callable, Sequence


def first_difference(a: Sequence, b: Sequence, differ: Callable = operator.is_not) -> int:
    """The first index where `differ(a[i], b[i])` (by default: they are not the
    same object), or the shorter length."""
    return next(compress(count(), map(differ, a, b)), min(len(a), len(b)))


_CHUNK = 512


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences: chunks
    compared whole (list equality, several times faster per token than a
    `map`), then the chunk that differs token by token."""
    n = min(len(a), len(b))
    for start in range(0, n, _CHUNK):
        x, y = a[start:start + _CHUNK], b[start:start + _CHUNK]
        if x != y:  # or only their lengths or types differ (a list and a tuple)
            k = first_difference(x, y, operator.ne)
            if k < min(len(x), len(y)):
                return start + k
    return n
