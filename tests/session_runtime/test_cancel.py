"""A step stops between two tokens when it is cancelled (its client went away),
runs past the request deadline, or the runtime shuts down; it fails and
changes nothing: the conversation then steps exactly as if it never ran."""

from __future__ import annotations

import threading
import time

import pytest

from session_runtime import Runtime, RuntimeConfig
from session_runtime.backends.base import Cancellation
from session_runtime.errors import DeadlineExceeded, ShuttingDown, StepCancelled


def _runtime(**kw) -> Runtime:
    return Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=8192, max_context=2048, **kw),
                   background=False)


def _run_until(rt, cid, tokens: int, cancel=None):
    """Start a 1,000-token step in a thread; return it once `tokens` are out."""
    out, started = {}, threading.Event()
    count = [0]

    def on_token(_):
        count[0] += 1
        if count[0] == tokens:
            started.set()

    def run():
        try:
            out["step"] = rt.send_message(cid, "Write a lot.", max_tokens=1000, on_token=on_token, cancel=cancel)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    return t, out


def _unchanged(rt, cid, twin):
    """The cancelled conversation has no turn, and steps as a twin that never ran."""
    assert rt.get(cid).turns == [] and rt.get(cid).history == []
    assert rt.send_message(cid, "Hi.", max_tokens=6).output_ids == rt.send_message(twin, "Hi.", max_tokens=6).output_ids
    rt.check_integrity()


def test_a_cancelled_step_stops_and_changes_nothing():
    rt = _runtime()
    try:
        cid, twin = rt.create_conversation(system="Same."), rt.create_conversation(system="Same.")
        cancel = Cancellation()
        t, out = _run_until(rt, cid, 5, cancel)
        cancel.cancel(StepCancelled("the client disconnected"))
        t.join(30)
        assert isinstance(out.get("error"), StepCancelled) and "step" not in out
        _unchanged(rt, cid, twin)
    finally:
        rt.close()


def test_a_step_past_the_request_deadline_fails_with_408_and_changes_nothing():
    rt = _runtime(request_deadline_s=3)
    try:
        cid, twin = rt.create_conversation(system="Same."), rt.create_conversation(system="Same.")
        with pytest.raises(DeadlineExceeded) as err:
            rt.send_message(cid, "Write a lot.", max_tokens=1000)
        assert err.value.status == 408
        _unchanged(rt, cid, twin)
    finally:
        rt.close()


def test_shutdown_cancels_the_steps_in_flight_within_seconds():
    rt = _runtime()
    cid = rt.create_conversation(system="Long.")
    t, out = _run_until(rt, cid, 5)
    t0 = time.monotonic()
    rt.close()
    t.join(30)
    assert time.monotonic() - t0 < 10
    assert isinstance(out.get("error"), ShuttingDown) and out["error"].status == 503


def test_watched_deadlines_fire_in_any_order_they_were_added():
    """The deadline thread is woken only for a deadline earlier than the one it
    waits for: a later one added while it waits, and an earlier one added after
    a far one, both fire on time."""
    fired: dict[str, float] = {}
    t0 = time.monotonic()
    stops = []
    for name, after_s in (("far", 1.2), ("near", 0.3), ("later", 0.8), ("gone", 0.5)):
        cancel = Cancellation(after_s)
        stops.append(cancel.watch(lambda name=name: fired.setdefault(name, time.monotonic() - t0)))
        if name == "gone":
            stops[-1]()  # no longer watched: never fires
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while len(fired) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(fired) == {"far", "near", "later"}
    for name, due in (("near", 0.35), ("later", 0.9), ("far", 1.2)):
        assert due <= fired[name] < due + 0.5, (name, fired)
