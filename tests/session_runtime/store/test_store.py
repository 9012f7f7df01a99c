"""The store writes what a step changed and reads back what was written: after
any sequence of the changes steps make (append, a turn's close rewriting its
messages, a client's other history, a turn record changed in place, a failed
write), a load equals the conversation in memory, and the bytes kept step by
step equal a whole write's; in SQLite and in PostgreSQL (a real server,
tests/postgres.py). A store of the first schema is migrated."""

from __future__ import annotations

import dataclasses
import json
import random
import sqlite3

import pytest

from session_runtime.accounting import StepAccounting
from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.store.sqlite import Store
from session_runtime.store.pg import PgStore
from session_runtime.store.delta import delta
from session_runtime.templates.base import Message, ToolCall


def _conv(cid: str = "c") -> Conversation:
    return Conversation(id=cid, system="Be terse.", tools=[{"type": "function", "function": {"name": "f"}}],
                        tenant="t", template="deepseek", policy=ReasoningPolicy("drop", 1),
                        materialize=MaterializeSettings("auto"), offload=OffloadSettings("never"))


def _step(rng: random.Random) -> StepAccounting:
    n = rng.randrange(100)
    return StepAccounting(prompt_tokens=n, cached_input_tokens=n // 2, host_loaded_tokens=0,
                          uncached_prefill_tokens=n - n // 2, logical_reusable_tokens=n // 2,
                          alignment_loss_tokens=0, recomputed_history_tokens=1, active_context_length=n,
                          output_tokens=3, kv_device_bytes=4096 * n, kv_host_bytes=0, prefill_ms=1.5,
                          ttft_ms=2.5, tpot_ms=0.5, attention_work=n * n,
                          uncached=[{"reason": "new_input", "tokens": n - n // 2}])


def _message(rng: random.Random, turn: int) -> Message:
    role = rng.choice(["user", "assistant", "tool"])
    return Message(role, turn, content=f"text {rng.random()} é", reasoning="why" if role == "assistant" else "",
                   tool_calls=(ToolCall("call_1", "f", {"x": 1}),) if rng.random() < 0.2 else (),
                   output_ids=tuple(rng.randrange(1000) for _ in range(rng.randrange(5))))


def _change(conv: Conversation, rng: random.Random) -> None:
    """One of the changes a step, a turn's close or a client makes."""
    op = rng.randrange(7)
    turn = len(conv.turns)
    if op <= 1 or not conv.turns:  # a step: messages, trace, accounting (a new turn or the open one)
        new = [_message(rng, turn) for _ in range(rng.randrange(1, 3))]
        conv.history += new
        conv.trace += [TraceEntry(m, step=0, finish_reason="stop") for m in new]
        if op == 0 or not conv.turns:
            conv.turns.append(TurnRecord(index=turn))
        conv.turns[-1].steps.append(_step(rng))
    elif op == 2:  # a turn closes: its messages are rewritten (reasoning dropped), its record changes in place
        k = rng.randrange(len(conv.history) + 1)
        conv.history = conv.history[:k] + [dataclasses.replace(m, reasoning="") for m in conv.history[k:]]
        conv.turns[-1].closed, conv.turns[-1].fork_tokens = True, rng.randrange(50)
        conv.turns[-1].counterfactual = {"keep": {"prompt_tokens": 3}}
    elif op == 3:  # a client's other history: everything replaced, fewer turns
        keep = rng.randrange(len(conv.turns) + 1)
        conv.history = [dataclasses.replace(m) for m in conv.history[: 2 * keep]]
        conv.trace = [TraceEntry(m) for m in conv.history]
        conv.turns = [TurnRecord(index=i, closed=True) for i in range(keep)]
    elif op == 4:  # a new system prompt and tools
        conv.system, conv.tools = f"System {rng.random()}", [*conv.tools, {"type": "function"}]
    elif op == 5:  # tool calls pending
        conv.protocol = ProtocolState(turn, (ToolCall("call_2", "g", {}),), tuple(range(rng.randrange(9))))
        conv.version += 1
    else:  # a failed step's undo: the records are copies
        snap = conv.snapshot()
        conv.__dict__.update(snap.__dict__)


def _layers(conv: Conversation) -> dict:
    return {"system": conv.system, "tools": conv.tools, "tenant": conv.tenant, "policy": conv.policy,
            "history": conv.history, "trace": conv.trace, "protocol": conv.protocol, "version": conv.version,
            "turns": [dataclasses.asdict(t) for t in conv.turns]}


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """A function that opens the same store again (another process would)."""
    if request.param == "sqlite":
        return lambda: Store(tmp_path / "s.sqlite3")
    url = request.getfixturevalue("pg_url")
    return lambda: PgStore(url)


@pytest.mark.parametrize("seed", range(6))
def test_what_is_loaded_is_what_was_in_memory_after_any_changes(open_store, seed):
    rng = random.Random(seed)
    store = open_store()
    conv = _conv()
    try:
        for _ in range(60):
            _change(conv, rng)
            if rng.random() < 0.15:  # a write that fails changes nothing, and the next one writes it all
                real = store._write
                store._write = lambda *a, **k: (real(*a, **k), (_ for _ in ()).throw(sqlite3.OperationalError("io")))
                with pytest.raises(sqlite3.OperationalError):
                    store.save(conv)
                store._write = real
            size = store.save(conv)
            assert size == delta(conv, None).written.bytes  # kept by deltas, as a whole write counts it
            fresh = open_store()  # another reader: only what was committed
            loaded, parked = fresh.load("c")
            assert fresh._written["c"].bytes == size  # as the rows read back count it
            fresh.close()
            assert _layers(loaded) == _layers(conv) and not parked
            assert [s.id for s in store.index()] == ["c"] and store.index()[0].bytes == size
    finally:
        store.close()


def test_a_parked_conversation_comes_back_with_its_kv_state_in_this_process_only(open_store):
    from session_runtime.uncached import Known

    store = open_store()
    conv = _conv()
    conv.history = [Message("user", 0, "hi")]
    store.save(conv)
    conv.chain_tokens, conv.canonical_kind = [1, 2, 3], "prefix"
    conv.shadows = {"keep": [1, 2, 3, 4], "drop": [1, 2]}
    conv.known = Known(sequence=[1, 2, 3], diverged="policy_fork", kept=2)
    store.park(conv)
    back, parked = store.load("c")
    assert parked and back.chain_tokens == [1, 2, 3] and back.canonical_kind == "prefix"
    assert back.shadows == conv.shadows and back.known == dataclasses.replace(conv.known, sequence=[1, 2, 3])
    store.close()
    other = open_store()  # another process: its KV is not this one's
    back, parked = other.load("c")
    assert not parked and back.chain_tokens == [] and back.canonical_kind == "none"
    other.close()


def test_a_store_of_the_first_schema_is_migrated(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    db = sqlite3.connect(str(path))
    db.execute("CREATE TABLE conversations (id TEXT PRIMARY KEY, data TEXT NOT NULL, "
               "updated_at REAL NOT NULL DEFAULT (julianday('now')))")
    msg = {"role": "user", "turn": 0, "content": "Hello", "reasoning": "", "tool_calls": [], "tool_call_id": "",
           "output_ids": [], "wire": ""}
    answer = {**msg, "role": "assistant", "content": "Hi.", "reasoning": "Greet.", "output_ids": [5, 6, 1]}
    step = dataclasses.asdict(_step(random.Random(0)))
    doc = {"id": "old", "system": "S.", "tools": [], "tenant": None, "worker": "w0", "template": "deepseek",
           "policy": {"name": "keep", "keep_last_k": 1}, "materialize": {"mode": "never"},
           "offload": {"mode": "never"}, "history": [msg, answer],
           "trace": [{"message": msg, "step": None, "finish_reason": None, "created_at": 1.0},
                     {"message": answer, "step": 0, "finish_reason": "stop", "created_at": 2.0}],
           "turns": [{"index": 0, "closed": True, "fork_tokens": 7, "steps": [step]}], "protocol": None}
    db.execute("INSERT INTO conversations(id, data) VALUES(?, ?)", ("old", json.dumps(doc)))
    db.commit()
    db.close()
    store = Store(path)
    try:
        (conv,) = store.load_all()
        assert conv.id == "old" and conv.worker == "w0" and conv.policy.name == "keep"
        assert [m.content for m in conv.history] == ["Hello", "Hi."] and conv.history[1].output_ids == (5, 6, 1)
        assert conv.trace[1].created_at == 2.0 and conv.turns[0].fork_tokens == 7
        assert dataclasses.asdict(conv.turns[0].steps[0]) == step
        tables = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "conversations" not in tables
    finally:
        store.close()


def test_a_dropped_postgresql_connection_fails_one_write_and_the_next_one_reconnects(pg_url):
    """The server drops the store's connection (a restart, a failover, an admin):
    the write under way fails and changes nothing; the next one reconnects and
    writes everything that differs."""
    import psycopg

    store = PgStore(pg_url)
    conv = _conv()
    conv.history = [Message("user", 0, "before")]
    store.save(conv)
    pid = store._db.info.backend_pid
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    conv.history = [*conv.history, Message("user", 0, "after")]
    with pytest.raises(psycopg.OperationalError):
        store.save(conv)
    store.save(conv)
    other = PgStore(pg_url)
    assert [m.content for m in other.load("c")[0].history] == ["before", "after"]
    other.close()
    store.close()


def test_a_step_is_written_in_four_statements_however_many_rows_it_adds(tmp_path):
    """BEGIN, one statement of rows, the conversation's row, COMMIT: no DELETE where
    rows are only added or rewritten at their keys (each SQLite statement releases
    the GIL to another step's thread; over PostgreSQL each is a round trip)."""
    store = Store(tmp_path / "s.sqlite3")
    rng = random.Random(1)
    conv = _conv()
    store.save(conv)
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    for turn in range(3):
        seen.clear()
        new = [_message(rng, turn) for _ in range(2)]
        conv.history = conv.history[:-1] + [dataclasses.replace(conv.history[-1], reasoning="")] + new \
            if conv.history else new  # the turn before closes: its last message is rewritten
        conv.trace += [TraceEntry(m) for m in new]
        conv.turns.append(TurnRecord(index=turn, steps=[_step(rng)]))
        store.save(conv)
        assert [s.split()[0] for s in seen] == ["BEGIN", "INSERT", "UPDATE", "COMMIT"], seen
    conv.history = conv.history[:2]  # a client's shorter history: only then a DELETE (and the last
    seen.clear()  # turn's record, written again at every save)
    store.save(conv)
    assert [s.split()[0] for s in seen] == ["BEGIN", "DELETE", "INSERT", "UPDATE", "COMMIT"], seen
    assert _layers(store.load("c")[0]) == _layers(conv)
    store.close()


def test_a_step_is_one_round_trip_to_postgresql(pg_url, tmp_path):
    """The transaction's statements are pipelined: everything is sent before the
    first answer is read (libpq's own trace of the protocol's messages)."""
    store = PgStore(pg_url)
    conv = _conv()
    conv.history = [Message("user", 0, "a")]
    store.save(conv)
    trace = tmp_path / "trace"
    with trace.open("w") as f:
        store._db.pgconn.trace(f.fileno())
        conv.history = [*conv.history, Message("assistant", 0, "b")]
        conv.turns = [TurnRecord(index=0, steps=[_step(random.Random(0))])]
        store.save(conv)
        store._db.pgconn.untrace()
    directions = [line.split("\t")[1] for line in trace.read_text().splitlines()]
    turns = [d for i, d in enumerate(directions) if i == 0 or d != directions[i - 1]]
    assert turns == ["F", "B"], turns
    assert _layers(PgStore(pg_url).load("c")[0]) == _layers(conv)
    store.close()
