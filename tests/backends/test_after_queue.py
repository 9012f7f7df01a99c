"""The queue of commands sent after a step (backends/sglang/after.py): in
order per conversation, concurrent across conversations, `settle` waits for
what is queued, a failure is logged and does not stop what follows."""

from __future__ import annotations

import threading
import time

from session_runtime.backends.sglang.after import OwnerQueue


def test_commands_run_in_order_per_owner_and_settle_waits_for_them():
    q = OwnerQueue(workers=4)
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def cmd(owner: str, i: int, delay: float):
        def run():
            time.sleep(delay)
            with lock:
                seen.append((owner, i))
        return run

    try:
        for i in range(5):
            q.submit("a", cmd("a", i, 0.02 * (5 - i)), "test")  # later ones are quicker: order must still hold
            q.submit("b", cmd("b", i, 0.0), "test")
        q.settle("b")
        assert [i for o, i in seen if o == "b"] == list(range(5))
        q.settle()
        assert [i for o, i in seen if o == "a"] == list(range(5)) and q.sent == 10
    finally:
        q.close()


def test_a_failing_command_is_logged_and_the_next_one_still_runs(caplog):
    q = OwnerQueue(workers=1)
    ran = []
    try:
        q.submit("a", lambda: 1 / 0, "the turn's close")
        q.submit("a", lambda: ran.append(True), "the tool wait's start")
        q.settle()
        assert ran == [True] and "the turn's close of a failed after its step" in caplog.text
    finally:
        q.close()


def test_a_command_rides_the_next_step_or_goes_on_its_own_after_ride_s():
    q = OwnerQueue(workers=2, ride_s=0.3)
    sent: list[str] = []
    try:
        q.submit("a", lambda: sent.append("close a"), "close", ("close", {"owner": "a"}))
        q.submit("a", lambda: sent.append("wait a"), "wait", ("wait", {"owner": "a"}))
        # The next step takes both, in order; nothing was sent on its own.
        assert q.take("a") == [("close", {"owner": "a"}), ("wait", {"owner": "a"})]
        assert q.take("a") == [] and q.rode == 2
        time.sleep(0.5)
        assert sent == [] and q.sent == 0
        # Nobody steps within ride_s: it goes on its own.
        q.submit("b", lambda: sent.append("close b"), "close", ("close", {"owner": "b"}))
        time.sleep(0.6)
        q.settle()
        assert sent == ["close b"] and q.sent == 1 and q.take("b") == []
        # settle sends what waits at once; a plain command queued after a riding one keeps the order.
        q.submit("c", lambda: sent.append("close c"), "close", ("close", {"owner": "c"}))
        q.submit("c", lambda: sent.append("release c"), "release")
        q.settle("c")
        assert sent[-2:] == ["close c", "release c"]
        q.submit("d", lambda: sent.append("close d"), "close", ("close", {"owner": "d"}))
        q.settle()
        assert sent[-1] == "close d"
        # A step that failed hands what it took back: sent on its own.
        q.submit("e", lambda: None, "close", ("close", {"owner": "e"}))
        took = q.take("e")
        q.resend("e", took, lambda name, args: sent.append(f"{name} {args['owner']} again"))
        q.settle("e")
        assert sent[-1] == "close e again"
    finally:
        q.close()


def test_what_no_step_took_leaves_in_one_batch_and_what_follows_waits_for_it():
    batches: list[list] = []
    sent: list[str] = []
    q = OwnerQueue(workers=2, ride_s=0.2,
                   send_batch=lambda commands: (time.sleep(0.1), batches.append(commands))[1] or
                   [{"ok": True}] * len(commands))
    try:
        for owner in ("a", "b", "c"):
            q.submit(owner, lambda: None, "close", ("close", {"owner": owner}))
        q.submit("a", lambda: None, "wait", ("wait", {"owner": "a"}))
        assert q.take("c") == [("close", {"owner": "c"})]  # c stepped again: its close rode that step
        time.sleep(0.3)  # the timer: a's and b's leave together, in order, as one request
        q.submit("a", lambda: sent.append("release a"), "release")  # after the batch, for a
        q.settle()
        assert batches == [[("close", {"owner": "a"}), ("wait", {"owner": "a"}), ("close", {"owner": "b"})]]
        assert sent == ["release a"] and q.sent == 2 and q.batched == 3 and q.rode == 1
    finally:
        q.close()


def test_a_failed_command_in_a_batch_is_logged(caplog):
    q = OwnerQueue(workers=1, ride_s=10.0, send_batch=lambda commands: [
        {"ok": False, "error": {"message": "no chain"}}, {"ok": True}])
    try:
        q.submit("a", lambda: None, "close", ("close", {"owner": "a"}))
        q.submit("b", lambda: None, "close", ("close", {"owner": "b"}))
        q.settle()  # sends what waits at once, without waiting for ride_s
        assert q.sent == 1 and "the close of a failed after its step" in caplog.text
        assert "of b failed" not in caplog.text
    finally:
        q.close()
