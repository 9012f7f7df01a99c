"""Conversations in memory are bounded, and nothing is lost by it: a runtime
whose conversations keep leaving memory (--max-resident-conversations 1)
answers and accounts every step exactly as one that keeps them all, their
chains held all along; a restart over 10,000 stored conversations reads
only the index and holds in memory only what it has touched."""

from __future__ import annotations

from session_runtime import Runtime, RuntimeConfig
from session_runtime.store.sqlite import Store
from session_runtime.store.delta import delta

FORCED = {"reasoning": "Think it over first.", "content": "A short answer."}
CALL = {"reasoning": "Use the tool.", "tool_calls": [{"name": "calc", "arguments": {"x": 1}}]}


def _runtime(data_dir, resident: int) -> Runtime:
    return Runtime(RuntimeConfig(model="tiny", pool_tokens=8192, max_context=1024, data_dir=str(data_dir),
                                 max_resident_conversations=resident), background=False)


def _figures(step) -> dict:
    a = step.accounting
    return {"output": list(step.output_ids), "prompt": a.prompt_tokens, "cached": a.cached_input_tokens,
            "uncached": a.uncached, "state": a.cache_state, "counterfactual": a.counterfactual,
            "context": a.active_context_length, "device_bytes": a.kv_device_bytes}


def _workload(rt: Runtime) -> tuple[list[dict], list[str]]:
    """Three conversations stepped in turn: turns that drop their reasoning, a tool chain between them."""
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    ids = [rt.create_conversation(system=f"Agent {i}.", tools=tools, materialize="never",
                                  conversation_id=f"c{i}") for i in range(3)]
    out = []
    for turn in range(3):
        for cid in ids:
            if turn == 1:
                out.append(_figures(rt.send_message(cid, f"Turn {turn} of {cid}?", forced=CALL)))
                call = rt.get(cid).protocol.pending_calls[0].id
                out.append(_figures(rt.send_tool_results(cid, [{"tool_call_id": call, "content": "2"}],
                                                         forced=FORCED)))
            else:
                out.append(_figures(rt.send_message(cid, f"Turn {turn} of {cid}?", forced=FORCED)))
    return out, ids


def test_conversations_that_leave_memory_step_and_account_as_if_they_had_stayed(tmp_path):
    oracle = _runtime(tmp_path / "all", 0)
    try:
        expected, _ = _workload(oracle)
    finally:
        oracle.close()
    rt = _runtime(tmp_path / "one", 1)
    try:
        got, ids = _workload(rt)
        assert rt.conversations.resident == 1 and len(rt.conversations) == 3
        assert got == expected
        assert any(f["cached"] for f in got[3:])  # the chains were held while their conversations were out
        rt.check_integrity()
        for cid in ids:  # what is stored is what the conversation holds
            conv = rt.get(cid)
            assert rt.table.size_of(cid) == delta(conv, None).written.bytes
    finally:
        rt.close()


def test_a_restart_over_ten_thousand_conversations_reads_only_what_it_touches(tmp_path):
    seed = _runtime(tmp_path, 0)
    try:
        cid = seed.create_conversation(system="The one used.", conversation_id="used")
        seed.send_message(cid, "Hello?", forced=FORCED)
        template = seed.get(cid)
    finally:
        seed.close()
    store = Store(tmp_path / "conversations.sqlite3")
    try:
        def many() -> None:  # 9,999 more, in one transaction
            for i in range(9999):
                conv = template.snapshot()
                conv.id, conv.tenant = f"c{i:05d}", f"tenant{i % 7}"
                d = delta(conv, None)
                store._write(conv, d, d.written.bytes, fresh=True)
        store._transaction(many)
    finally:
        store.close()
    rt = _runtime(tmp_path, 100)
    try:
        assert len(rt.conversations) == 10000 and rt.conversations.resident == 0
        assert len(rt.conversations_of("tenant3")) == len(range(3, 9999, 7))
        step = rt.send_message("used", "Again?", forced=FORCED)
        assert step.turn == 1 and rt.get("c00042").tenant == "tenant0"
        assert rt.conversations.resident == 2
        assert rt.table.held("tenant0") == sum(rt.table.size_of(f"c{i:05d}") for i in range(0, 9999, 7))
    finally:
        rt.close()
