"""Where two sequences part (session_runtime/sequences.py): the chunked token
comparison equals the token-by-token one, for lists and tuples alike."""

from __future__ import annotations

import operator
import random

from session_runtime.sequences import common_prefix, first_difference


def test_common_prefix_equals_a_token_by_token_comparison():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randrange(0, 1600)
        a = [rng.randrange(4) for _ in range(n)]
        b = a[:rng.randrange(0, n + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 1200))]
        for x, y in ((a, b), (tuple(a), b), (a, tuple(b)), (b, a)):
            assert common_prefix(x, y) == first_difference(x, y, operator.ne)


def test_first_difference_is_by_identity():
    one, other = [1000 + 1], [1000 + 1]
    xs = [object(), one]
    assert first_difference(xs, [xs[0], other]) == 1  # equal, not the same object
    assert first_difference(xs, list(xs)) == 2
