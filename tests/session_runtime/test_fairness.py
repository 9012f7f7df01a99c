"""Concurrent steps on the embedded engine take turns token by token: a short
request never waits for a long generation to finish, every step in flight
gives the same tokens as alone, and more concurrent steps than request rows
wait for a place instead of failing."""

from __future__ import annotations

import threading

import pytest

from session_runtime import Runtime, RuntimeConfig


@pytest.fixture
def rt():
    runtime = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=8192, max_context=2048, max_running=3),
                      background=False)
    yield runtime
    runtime.close()


def test_a_one_token_request_finishes_while_a_long_generation_runs(rt):
    long_cid, short_cid = rt.create_conversation(system="Long."), rt.create_conversation(system="Short.")
    started, tokens, seen = threading.Event(), [], {}

    def on_token(tok):
        tokens.append(tok)
        if len(tokens) == 5:
            started.set()

    def long_step():
        seen["long"] = rt.send_message(long_cid, "Write a lot.", max_tokens=300, on_token=on_token)

    t = threading.Thread(target=long_step)
    t.start()
    assert started.wait(60)
    rt.send_message(short_cid, "One word.", max_tokens=1)
    seen["long_tokens_when_short_done"] = len(tokens)
    t.join(120)
    assert seen["long"].accounting.output_tokens == 300
    assert seen["long_tokens_when_short_done"] < 300  # it did not wait for the long one
    rt.check_integrity()


def test_interleaved_steps_give_the_tokens_they_give_alone(rt):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(5)]  # more than the 3 request rows
    alone = []
    for p in prompts:
        cid = rt.create_conversation(system="Alone.")
        alone.append(rt.send_message(cid, p, max_tokens=12).output_ids)
    together: dict[int, list[int]] = {}

    def run(i):
        cid = rt.create_conversation(system="Alone.")
        together[i] = rt.send_message(cid, prompts[i], max_tokens=12).output_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(len(prompts))] == alone
    rt.check_integrity()


def test_the_fair_lock_is_reentrant_hands_over_in_arrival_order_and_times_out():
    import time

    from session_runtime.backends.embedded.fairlock import FairRLock

    lock, order = FairRLock(), []
    lock.acquire()
    lock.acquire()  # reentrant
    waiters = []
    for name in "abc":
        t = threading.Thread(target=lambda n=name: (lock.acquire(), order.append(n), lock.release()))
        t.start()
        waiters.append(t)
        while lock.waiting() < len(waiters):
            time.sleep(0.001)
    assert lock.acquire(timeout=0.01)  # the holder re-enters, whoever waits
    lock.release()
    got = []
    other = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.05)))
    other.start()
    other.join()
    assert got == [False] and lock.waiting() == 3  # a timed-out waiter leaves the queue
    assert lock.yield_to_waiters() and order == ["a", "b", "c"]  # everyone queued went first, in order
    lock.release()
    lock.release()
    for t in waiters:
        t.join()
