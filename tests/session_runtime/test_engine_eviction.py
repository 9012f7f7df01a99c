"""Eviction and pool exhaustion through the Engine, on a pool of 8 pages of 16.

Unlocked LRU leaves (released conversations' branches) go first; a request
that cannot fit even after evicting every unlocked leaf raises PoolExhausted
and leaves every chain, its KV and the pool accounting intact; a later smaller
request still works.
"""

from __future__ import annotations

import pytest

from radix_ext.tree import Namespace
from session_runtime.config import RuntimeConfig
from session_runtime.backends.embedded.engine import Engine, StepRequest
from session_runtime.errors import InvalidRequest, PoolExhausted
from session_runtime.sampling import SamplingParams

NS = Namespace(extra_key="evict")
PAGE = 16


def seq(start: int, n: int) -> list[int]:
    return [(start + i) % 1000 for i in range(n)]


def make_engine(decoder, pages: int = 8) -> Engine:
    return Engine(RuntimeConfig(page_size=PAGE, pool_tokens=pages * PAGE, max_context=256), decoder)


def run(engine, owner, prompt, forced=(), max_tokens=1, logits=False):
    return engine.step(
        StepRequest(owner=owner, prompt=prompt, namespace=NS, sampling=SamplingParams(max_tokens=max_tokens),
                    forced=None if forced is None else list(forced), return_logits=logits)
    )


def free(engine) -> int:
    return engine.pools.allocator.available_size()


def cached(engine, tokens) -> int:
    return engine.tree.probe(NS.key(tokens)).device_len


def chains(engine) -> dict:
    """Each chain's length and the exact slots (KV pages) it holds."""
    return {o: (engine.tree.chain_tokens(o), engine.tree.chain_slots(o).tolist()) for o in engine.tree.chains}


def test_lru_eviction_exhaustion_and_recovery(small_decoder):
    engine = make_engine(small_decoder)
    assert engine.pools.capacity == 128
    A, B, C = seq(1, 32), seq(101, 32), seq(201, 32)
    for owner, prompt in (("A", A), ("B", B), ("C", C)):
        r = run(engine, owner, prompt)
        assert r.accounting.cached_input_tokens == 0 and engine.tree.chain_tokens(owner) == 32
    assert free(engine) == 32
    engine.check_integrity()

    # B and C are deleted (B first): their branches become unlocked leaves, B the LRU.
    engine.release("B")
    engine.release("C")
    assert (engine.tree.protected_size(), engine.tree.evictable_size()) == (32, 64)
    engine.check_integrity()

    # D needs 3 pages, 2 are free: evicting the LRU leaf (B's 2 pages) is enough.
    D = seq(301, 48)
    run(engine, "D", D)
    assert cached(engine, B) == 0
    assert cached(engine, C) == 32 and cached(engine, A) == 32
    assert engine.tree.chain_tokens("D") == 48
    assert free(engine) == 16
    assert (engine.tree.protected_size(), engine.tree.evictable_size()) == (80, 32)
    engine.check_integrity()
    before = chains(engine)
    assert set(before) == {"A", "D"}

    # E needs 7 pages; 1 is free and 2 evictable: PoolExhausted, nothing of A or D touched.
    with pytest.raises(PoolExhausted) as exc:
        run(engine, "E", seq(401, 100))
    assert not isinstance(exc.value, InvalidRequest) and exc.value.status == 507
    assert chains(engine) == before
    assert free(engine) + engine.tree.evictable_size() == 48  # every unlocked token, free or evictable
    assert engine.tree.protected_size() == 80
    engine.check_integrity()

    # F's prompt fits (3 pages, evicting C) but its decode needs a 4th page: it fails mid-decode
    # and gives back every page it took.
    with pytest.raises(PoolExhausted):
        run(engine, "F", seq(501, 48), forced=None, max_tokens=20)
    assert chains(engine) == before and "F" not in engine.tree.chains
    assert cached(engine, C) == 0
    assert free(engine) == 48 and engine.tree.evictable_size() == 0
    engine.check_integrity()

    # A smaller request still works: 20 prompt + 4 fed tokens -> a 24-token chain,
    # one page in the tree and its partial last page held privately (a whole page).
    G = seq(601, 20)
    g = run(engine, "G", G, forced=None, max_tokens=5)
    assert len(g.output) == 5 and g.finish_reason == "length"
    assert engine.tree.chain_tokens("G") == 24 and free(engine) == 16
    engine.check_integrity()

    # A's KV survived the churn: its continuation matches a cold engine's exactly.
    cont = A + seq(701, 9)
    warm = run(engine, "A", cont, logits=True)
    assert warm.accounting.cached_input_tokens == 32
    cold_engine = make_engine(small_decoder, pages=16)
    cold = run(cold_engine, "A", cont, logits=True)
    assert cold.accounting.cached_input_tokens == 0
    ref = cold.logits[32:]
    assert float((warm.logits - ref).abs().max() / ref.abs().max()) < 1e-5
    assert warm.output == cold.output
    # A's 41 tokens: its 2 tree pages plus a private page for the last 9.
    assert engine.tree.chain_tokens("A") == 41 and free(engine) == 0
    engine.check_integrity()
    cold_engine.check_integrity()


def test_shared_prefix_stays_while_released_branches_go_in_lru_order(small_decoder):
    engine = make_engine(small_decoder)
    S = seq(1, 32)  # a shared 32-token prefix (system prompt)
    P = {name: S + seq(100 * (i + 1), 16) for i, name in enumerate(("P1", "P2", "P3"))}
    r = run(engine, "P1", P["P1"])
    assert r.accounting.cached_input_tokens == 0
    for name in ("P2", "P3"):
        assert run(engine, name, P[name]).accounting.cached_input_tokens == 32
    assert free(engine) == 128 - 32 - 3 * 16
    shared = [n for n in engine.tree.snapshot() if n.depth_tokens == 32]
    assert len(shared) == 1 and shared[0].owners == ("P1", "P2", "P3") and shared[0].lock_count == 3
    engine.check_integrity()

    engine.release("P1")
    engine.release("P3")
    assert engine.tree.evictable_size() == 32

    # Q needs 4 pages, 3 are free: only P1's branch (the LRU leaf) goes.
    Q = seq(501, 64)
    run(engine, "Q", Q)
    assert cached(engine, P["P1"]) == 32  # its branch is gone, the shared prefix is not
    assert cached(engine, P["P3"]) == 48
    assert cached(engine, P["P2"]) == 48
    assert free(engine) == 0
    engine.check_integrity()

    # Nothing fits now except by evicting P3's branch; the shared prefix is locked by P2.
    with pytest.raises(PoolExhausted):
        run(engine, "R", seq(801, 40))
    assert cached(engine, P["P2"]) == 48 and cached(engine, Q) == 64
    assert {o: engine.tree.chain_tokens(o) for o in engine.tree.chains} == {"P2": 48, "Q": 64}
    engine.check_integrity()

    # Releasing P2 frees the shared prefix too once nothing else holds it.
    engine.release("P2")
    run(engine, "R", seq(801, 40))
    assert cached(engine, S) == 0 and cached(engine, Q) == 64
    assert engine.tree.chain_tokens("R") == 40  # 2 tree pages + 8 tokens in its private page
    engine.check_integrity()


def test_failed_step_frees_its_request_row(small_decoder):
    engine = make_engine(small_decoder, pages=2)
    rows = engine.pools.req_to_token.available_size()
    for _ in range(engine.config.max_running + 2):  # more failures than rows
        with pytest.raises(PoolExhausted):
            run(engine, "X", seq(1, 40))
    assert engine.pools.req_to_token.available_size() == rows
    assert free(engine) == 32 and engine.tree.chains == {}
    engine.check_integrity()
    run(engine, "X", seq(1, 20))
    # 16 in the tree, the last 4 in a private page: both pages are used.
    assert engine.tree.chain_tokens("X") == 20 and free(engine) == 0
    engine.check_integrity()
