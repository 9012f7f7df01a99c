"""SGLang's scheduler really uses our tree, and the conversations' chains
survive its eviction: a flood of unrelated requests (pool 2048 tokens) makes
the scheduler evict, and evicts no conversation's chain. The control channel
answers, and refuses bad commands, while requests run."""

from __future__ import annotations

import threading

import httpx
import pytest

from radix_ext.sglang.control import BadCommand, StaleCommand
from tests.conftest import SGLANG_CONTEXT, SGLANG_POOL

PAGE = 16


def _generate(url: str, ids: list[int], new: int = 4) -> dict:
    r = httpx.post(f"{url}/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


@pytest.fixture
def rt(sglang_rt):
    return sglang_rt


def test_the_scheduler_uses_the_session_tree(rt):
    info = httpx.get(f"{rt.backend.url}/server_info", timeout=30).json()
    assert info["radix_cache_backend"] == "session" and info["page_size"] == PAGE
    # No --max-context was given: the folder's max_position_embeddings (4096, not 32768) went to SGLang.
    assert info["context_length"] == SGLANG_CONTEXT == rt.config.max_context == rt.backend.max_context
    assert rt.backend.control.call("ping") == {"backend": "session", "page_size": PAGE, "capacity": SGLANG_POOL,
                                               "sglang": "0.5.23", "tp_size": 1}
    # The host arena was allocated when the runtime connected, at the size it gave (issue 22), not by a step.
    host = rt.backend.pools()["host"]
    assert rt.backend.host_tokens > 0 and host["capacity_tokens"] == rt.backend.host_tokens


def test_a_flood_of_unrelated_requests_evicts_no_chain(rt):
    backend = rt.backend
    held = {}
    for i in range(2):
        cid = rt.create_conversation(system=f"Chain keeper {i}: a system prompt that spans some pages. " * 3,
                                     policy="keep")
        step = rt.send_message(cid, "Remember this.", forced={"reasoning": "Noted.", "content": "Done." * 10})
        held[cid] = backend.chain_tokens(cid)
        assert held[cid] == step.accounting.active_context_length > 0  # its private partial page too
    nodes_before = {n.id: n for n in rt.tree_snapshot() if n.owners}
    # 20 distinct 200-token prompts: 4000 tokens through a 2048-token pool.
    first = [7000 + j for j in range(200)]
    _generate(backend.url, first)
    assert backend.probe(rt.namespace(rt.get(next(iter(held)))), [1]).device_len == 0
    for i in range(1, 20):
        _generate(backend.url, [10000 + 300 * i + j for j in range(200)])
    # The first flood prompt was evicted (SGLang needed its pages) ...
    got = httpx.post(f"{backend.url}/generate", timeout=300, json={
        "input_ids": first, "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert got["cached_tokens"] == 0
    # ... and every chain is intact: same nodes, same lengths, fully reused.
    assert backend.chain_lengths() == held
    nodes_after = {n.id: n for n in rt.tree_snapshot() if n.owners}
    assert set(nodes_after) == set(nodes_before)
    for cid, tokens in held.items():
        step = rt.send_message(cid, "And now?", forced={"content": "Still here."})
        assert step.accounting.cached_input_tokens == tokens
    rt.check_integrity()


def test_control_commands_while_requests_run(rt):
    backend = rt.backend
    cid = rt.create_conversation(system="A conversation whose chain the commands target. " * 2, policy="keep")
    rt.send_message(cid, "Hi", forced={"content": "Hello there, friend."})
    tokens = backend.chain_tokens(cid)
    stop, errors, calls = threading.Event(), [], [0]

    def load(i):
        while not stop.is_set():
            try:
                _generate(backend.url, [20000 + 50 * i + j for j in range(40)], new=8)
            except Exception as exc:  # reported below
                errors.append(repr(exc))
                return

    def commands():
        while not stop.is_set():
            try:
                assert backend.chain_lengths()[cid] == tokens
                assert any(cid in n.owners for n in backend.snapshot(str))
                with pytest.raises(StaleCommand):
                    backend.control.call("release", owner=cid, expect_tokens=tokens + 1)
                with pytest.raises(BadCommand):
                    backend.control.call("hold_prefix", owner=cid, tokens="nope")
                calls[0] += 1
            except Exception as exc:  # reported below
                errors.append(repr(exc))
                return

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=commands) for _ in range(4)]
    for t in threads:
        t.start()
    threading.Event().wait(8.0)
    stop.set()
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and calls[0] >= 8
    assert backend.chain_lengths()[cid] == tokens
    rt.check_integrity()
