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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    return first_difference(a, b, operator.ne)
