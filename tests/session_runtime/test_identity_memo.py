"""bounded_cache.IdentityMemo: a value per object identity, within a byte bound."""

from __future__ import annotations

from session_runtime.bounded_cache import IdentityMemo


def test_a_value_per_object_not_per_content():
    calls = []
    memo = IdentityMemo(1 << 20, lambda obj, value: 100)
    a, b = [1, 2], [1, 2]
    compute = lambda obj: calls.append(obj) or sum(obj)  # noqa: E731
    assert memo.get(a, compute) == 3 and memo.get(a, compute) == 3
    assert memo.get(b, compute) == 3  # equal, but another object: computed again
    assert calls == [a, b] and calls[0] is a and calls[1] is b


def test_the_object_is_kept_alive_so_its_id_is_never_reused_while_kept():
    memo = IdentityMemo(1 << 20, lambda obj, value: 100)
    key = id(memo.get([5], lambda obj: obj))  # the list lives on in the memo
    assert memo.get([6], sum) == 6 and len(memo) == 2
    assert key != id([7])  # a new object cannot take a kept one's id


def test_bounded_by_bytes_least_recent_out_and_huge_values_not_kept():
    memo = IdentityMemo(800, lambda obj, value: len(value))
    objs = [object() for _ in range(10)]
    for o in objs:
        memo.get(o, lambda _: "x" * 100)
    assert len(memo) == 8  # 800 bytes of 100-byte values
    huge = object()
    memo.get(huge, lambda _: "y" * 500)  # over an eighth of the bound: not kept
    assert len(memo) == 8
