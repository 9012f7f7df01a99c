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
