"""Placement: consistent hashing with bounded loads (session_runtime/placement.py),
and the worker a conversation keeps across a restart."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from session_runtime import placement


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), keys=st.integers(1, 300), eps=st.sampled_from([0.1, 0.25, 1.0]))
def test_no_worker_goes_above_the_bound(n, keys, eps):
    workers = [f"w{i}" for i in range(n)]
    loads = {w: 0 for w in workers}
    points = placement.ring(workers)
    for k in range(keys):
        w = placement.place(f"conv-{k}", loads, eps, points)
        loads[w] += 1
        assert max(loads.values()) <= math.ceil((1 + eps) * (k + 1) / n)


def test_the_same_id_lands_on_the_same_worker_and_few_move_when_one_goes():
    workers = [f"w{i}" for i in range(8)]
    first = {f"c{k}": placement.place(f"c{k}", {w: 0 for w in workers}, 0.25) for k in range(400)}
    again = {f"c{k}": placement.place(f"c{k}", {w: 0 for w in workers}, 0.25) for k in range(400)}
    assert first == again
    fewer = {w: 0 for w in workers if w != "w3"}
    moved = sum(1 for c, w in first.items() if w != "w3" and placement.place(c, fewer, 0.25) != w)
    assert moved == 0  # only w3's conversations move (unloaded ring: no bound in the way)
    assert len(set(first.values())) == 8


def test_no_live_worker_is_an_error():
    import pytest

    with pytest.raises(ValueError):
        placement.place("c", {})


def test_the_placement_is_kept_with_the_conversation(tmp_path):
    from session_runtime.conversation import Conversation
    from session_runtime.policies import MaterializeSettings, ReasoningPolicy
    from session_runtime.store.sqlite import Store

    conv = Conversation(id="c", system=None, tools=[], tenant=None, template="deepseek",
                        policy=ReasoningPolicy("drop"), materialize=MaterializeSettings("auto"), worker="w1")
    from session_runtime.offload import OffloadSettings

    conv.offload = OffloadSettings("never")
    store = Store(tmp_path / "s.sqlite3")
    store.save(conv)
    assert store.index()[0].worker == "w1" and store.load("c")[0].worker == "w1"
    store.close()
