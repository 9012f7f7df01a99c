"""The Runtime API over the 'tiny' preset: multi-turn reuse, forced replay,
errors that change nothing, sampling, logprobs and chain release.

One Runtime (pool 16384 tokens, context 256, page 16, no background
materializer) is shared by the session; every test makes its own
conversations with a unique system prompt so their first pages are not shared.
Multi-turn reuse is tested under policy="keep", where the chain is the
generated sequence (the default "drop" policy forks it at the reasoning).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from session_runtime.accounting import attention_work
from session_runtime.backends.embedded.engine import StepRequest
from session_runtime.errors import ContextTooLong, ConversationNotFound, InvalidRequest
from session_runtime.sampling import SamplingParams
from session_runtime.templates import Message
from session_runtime.turns import keep_all

PAGE = 16
TINY_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # K+V, 4 layers, 2 kv heads, head_dim 64, float32
FORCED = {"reasoning": "Think about it.", "content": "The answer is 42."}


@pytest.fixture
def rt(tiny_runtime):
    yield tiny_runtime
    tiny_runtime.check_integrity()


def first_prompt(rt, cid, text):
    conv = rt.get(cid)
    return rt.template(conv.template).render(conv.system, conv.tools, [Message("user", 0, text)], keep_all, True).ids


def state(rt, cid):
    """Everything a failed call must leave as it was (hit counts aside)."""
    conv = rt.get(cid)
    tree = rt.engine.tree
    nodes = sorted((n.id, n.tokens, n.lock_count, n.owners) for n in rt.tree_snapshot())
    return (
        list(conv.history), [dataclasses.asdict(t) for t in conv.turns], list(conv.chain_tokens),
        len(conv.trace), conv.protocol, conv.canonical_kind, tree.chain_tokens(cid), nodes,
        rt.engine.pools.allocator.available_size(), tree.protected_size(), tree.evictable_size(),
    )


def test_forced_multi_turn_exact_accounting(rt):
    assert len(rt.tokenizer.encode("You are terse.")) == 5
    cid = rt.create_conversation(system="You are terse.", policy="keep")
    tpl = rt.template("deepseek")
    assert len(tpl.forced_ids(FORCED["reasoning"], FORCED["content"])) == 12  # 4 + </think> + 6 + eos

    s1 = rt.send_message(cid, "Hello", forced=FORCED)
    assert (s1.reasoning, s1.content, s1.finish_reason, s1.turn) == ("Think about it.", "The answer is 42.", "forced", 0)
    assert s1.output_ids == tpl.forced_ids(FORCED["reasoning"], FORCED["content"])
    a = s1.accounting
    # bos + 5 system + <User> Hello <Assistant> + <think> = 10; + 12 forced = 22 computed.
    assert (a.prompt_tokens, a.cached_input_tokens, a.uncached_prefill_tokens, a.output_tokens) == (10, 0, 10, 12)
    assert (a.recomputed_history_tokens, a.logical_reusable_tokens, a.attention_work) == (0, 0, 55)
    # The chain holds all 22: one full page in the tree, 6 in its private page.
    assert a.kv_device_bytes == 22 * TINY_BYTES_PER_TOKEN == 90112
    assert len(rt.get(cid).chain_tokens) == 22
    assert rt.engine.tree.chain_tokens(cid) == 22 and rt.engine.tree.private_tokens() == PAGE

    s2 = rt.send_message(cid, "Hello there", forced=FORCED)
    a = s2.accounting
    # 22 + <User> Hello there <Assistant> + <think> = 27; all 22 computed are
    # reused (16 from the tree, 6 from the chain's private page).
    assert (a.prompt_tokens, a.cached_input_tokens, a.uncached_prefill_tokens) == (27, 22, 5)
    assert (a.logical_reusable_tokens, a.alignment_loss_tokens) == (22, 0)
    assert a.recomputed_history_tokens == 0  # the history is the 22 computed tokens
    assert a.kv_device_bytes == 39 * TINY_BYTES_PER_TOKEN
    assert a.attention_work == attention_work(5, 22) == 125
    assert (s2.reasoning, s2.content, s2.turn) == ("Think about it.", "The answer is 42.", 1)

    s3 = rt.send_message(cid, "Hi", forced=FORCED)
    a = s3.accounting
    # 39 + <User> Hi <Assistant> + <think> = 43; all 39 computed are reused.
    assert (a.prompt_tokens, a.cached_input_tokens, a.uncached_prefill_tokens) == (43, 39, 4)
    assert a.recomputed_history_tokens == 0
    assert len(rt.get(cid).chain_tokens) == 55 and rt.engine.tree.chain_tokens(cid) == 55

    d = rt.describe(cid)
    assert (d["chain"]["sequence_tokens"], d["chain"]["cached_tokens"]) == (55, 55)
    assert d["chain"]["kv_device_bytes"] == 55 * TINY_BYTES_PER_TOKEN
    assert [(h["role"], h["content"], h["reasoning"]) for h in d["history"]] == [
        ("user", "Hello", ""), ("assistant", "The answer is 42.", "Think about it."),
        ("user", "Hello there", ""), ("assistant", "The answer is 42.", "Think about it."),
        ("user", "Hi", ""), ("assistant", "The answer is 42.", "Think about it."),
    ]
    mine = rt.tree_snapshot(cid)
    # The snapshot lists tree nodes: the 7 private tokens are not a node.
    assert sum(n.tokens for n in mine) == 48 and all(cid in n.owners for n in mine)


def test_greedy_multi_turn_reuses_the_computed_sequence(rt):
    cid = rt.create_conversation(system="You are a careful assistant (greedy multi-turn).", policy="keep")
    s1 = rt.send_message(cid, "Hello", max_tokens=8)
    prompt1 = first_prompt(rt, cid, "Hello")
    seq1 = list(rt.get(cid).chain_tokens)
    assert s1.accounting.prompt_tokens == len(prompt1)
    assert len(s1.output_ids) == 8 and s1.finish_reason == "length"
    assert seq1 == prompt1 + s1.output_ids[:-1]  # the last sampled token was never fed
    assert rt.engine.tree.chain_tokens(cid) == len(seq1)  # the partial page stays private

    s2 = rt.send_message(cid, "Now tell me more.", max_tokens=4)
    a = s2.accounting
    seq2 = rt.get(cid).chain_tokens
    prompt2 = seq2[: a.prompt_tokens]
    assert seq2 == prompt2 + s2.output_ids[:-1]
    assert prompt2[: len(seq1)] == seq1  # segment-wise rendering: a strict extension
    expected = len(seq1)  # its own continuation: the private partial page too
    assert expected % PAGE
    assert a.cached_input_tokens == expected
    assert a.uncached_prefill_tokens == len(prompt2) - expected


def test_errors_change_nothing(rt):
    cid = rt.create_conversation(system="Errors must not change anything.", policy="keep")
    rt.send_message(cid, "First", forced=FORCED)
    before = state(rt, cid)

    for bad in ("", "   \n"):
        with pytest.raises(InvalidRequest) as e:
            rt.send_message(cid, bad)
        assert isinstance(e.value, ValueError)
    with pytest.raises(InvalidRequest):
        rt.send_message(cid, "x", forced={"answer": "no such field"})
    with pytest.raises(InvalidRequest):
        rt.send_message(cid, "x", max_tokens=-1)
    with pytest.raises(InvalidRequest):
        rt.send_message(cid, "x", temperature=-0.5)
    with pytest.raises(ConversationNotFound) as e:
        rt.send_message("no-such-conversation", "Hello")
    assert isinstance(e.value, KeyError)
    with pytest.raises(ConversationNotFound):
        rt.describe("no-such-conversation")
    with pytest.raises(ConversationNotFound):
        rt.delete_conversation("no-such-conversation")

    long_msg = " ".join(["word"] * 300)
    assert len(rt.tokenizer.encode(long_msg)) >= 256
    with pytest.raises(ContextTooLong) as e:
        rt.send_message(cid, long_msg)
    assert isinstance(e.value, InvalidRequest) and isinstance(e.value, ValueError)

    assert state(rt, cid) == before
    rt.check_integrity()
    # ... and the conversation still works, reusing its chain.
    s = rt.send_message(cid, "Second", forced={"content": "fine"})
    assert s.turn == 1 and s.content == "fine"
    assert s.accounting.cached_input_tokens == before[6] > 0


def test_forced_output_past_the_context_is_context_too_long(rt):
    cid = rt.create_conversation(system="Forced output past the context.")
    before = state(rt, cid)
    try:
        with pytest.raises(ContextTooLong):
            rt.send_message(cid, "Hi", forced={"content": " ".join(["word"] * 300)})
    finally:
        assert state(rt, cid) == before
        rt.check_integrity()


def test_decode_stops_at_the_context_limit(rt):
    cid = rt.create_conversation(system="Context limit.")
    msg = " ".join(["word"] * 200)
    n = len(first_prompt(rt, cid, msg))
    assert 200 < n < 256
    s = rt.send_message(cid, msg, max_tokens=100)
    assert s.finish_reason == "length" and len(s.output_ids) == 256 - n
    assert s.accounting.prompt_tokens == n
    assert len(rt.get(cid).chain_tokens) == 255


def test_greedy_is_deterministic_and_shares_prefixes_across_conversations(rt):
    system = "Determinism check: " + " ".join(["alpha"] * 40)
    c1, c2 = rt.create_conversation(system=system), rt.create_conversation(system=system)
    s1 = rt.send_message(c1, "Hello", max_tokens=6)
    s2 = rt.send_message(c2, "Hello", max_tokens=6)
    assert s1.output_ids == s2.output_ids and s1.content == s2.content and s1.reasoning == s2.reasoning
    assert s1.accounting.cached_input_tokens == 0
    n = s2.accounting.prompt_tokens
    assert n > 32
    assert s2.accounting.cached_input_tokens == (n - 1) // PAGE * PAGE  # c1's prompt, shared
    # Another tenant never hits the first tenant's (here: no tenant's) cache.
    c3 = rt.create_conversation(system=system, tenant="other")
    s3 = rt.send_message(c3, "Hello", max_tokens=6)
    assert s3.accounting.cached_input_tokens == 0 and s3.output_ids == s1.output_ids


def test_seeded_temperature_sampling_is_reproducible(rt):
    outs = {}
    for name, seed in (("a", 123), ("b", 123), ("c", 124)):
        cid = rt.create_conversation(system="Sampling check.")
        outs[name] = rt.send_message(cid, "Hello", max_tokens=8, temperature=1.0, seed=seed).output_ids
    assert outs["a"] == outs["b"]
    assert outs["a"] != outs["c"]
    assert len(outs["a"]) == 8


def test_logprobs_lengths_and_forced_replay(rt):
    cid = rt.create_conversation(system="Logprobs check.", policy="keep")
    s = rt.send_message(cid, "Hello", max_tokens=6, logprobs=True)
    assert len(s.logprobs) == len(s.output_ids) == 6
    assert all(lp <= 0.0 for lp in s.logprobs)
    assert rt.send_message(cid, "Again", max_tokens=3).logprobs is None

    f = rt.send_message(cid, "Replay", forced=FORCED, logprobs=True)
    assert len(f.logprobs) == 12 and all(lp <= 0.0 for lp in f.logprobs)

    # Replaying the greedy output as forced tokens scores it the same.
    c2 = rt.create_conversation(system="Logprobs check.")
    try:
        r = rt.engine.step(
            StepRequest(owner="replay", prompt=first_prompt(rt, c2, "Hello"), namespace=rt.namespace(rt.get(c2)),
                        sampling=SamplingParams(logprobs=True), forced=s.output_ids)
        )
        assert r.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    finally:
        rt.engine.release("replay")


def test_delete_conversation_releases_the_chain(rt):
    cid = rt.create_conversation(system="Delete me: a chain of its own.", policy="keep")
    rt.send_message(cid, "Hello", forced=FORCED)
    rt.send_message(cid, "Hello there", forced={"content": "The answer is 42."})
    tree = rt.engine.tree
    assert tree.chain_tokens(cid) == 39  # 32 in the tree, 7 in the chain's private page
    mine = rt.tree_snapshot(cid)
    assert sum(n.tokens for n in mine) == 32
    assert all(n.lock_count == 1 and n.owners == (cid,) for n in mine)
    protected, evictable = tree.protected_size(), tree.evictable_size()

    rt.delete_conversation(cid)
    assert cid not in tree.chains and cid not in rt.conversations
    after = {n.id: n for n in tree.snapshot()}
    assert all(after[n.id].lock_count == 0 and after[n.id].owners == () for n in mine)
    assert (tree.protected_size(), tree.evictable_size()) == (protected - 32, evictable + 32)
    with pytest.raises(ConversationNotFound):
        rt.get(cid)
    with pytest.raises(ConversationNotFound):
        rt.delete_conversation(cid)
    rt.check_integrity()


def test_send_racing_delete_does_not_resurrect_the_chain(rt, monkeypatch):
    """Deterministic interleaving: delete_conversation holds the conversation's
    lock when send_message has already looked the conversation up."""
    cid = rt.create_conversation(system="Delete/send race probe.", policy="keep")
    rt.send_message(cid, "Hello", forced=FORCED)
    real_get, real_cancel = rt.table.get, rt.materializer.cancel
    sender_got_conv = threading.Event()
    outcome = []

    def get(conversation_id):
        conv = real_get(conversation_id)
        if threading.current_thread() is sender:
            sender_got_conv.set()
        return conv

    def send():
        try:
            outcome.append(rt.send_message(cid, "Again", forced={"content": "late"}))
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    sender = threading.Thread(target=send, daemon=True)

    def cancel(owner):  # runs inside delete_conversation, under the conversation's lock
        sender.start()
        assert sender_got_conv.wait(timeout=30)
        real_cancel(owner)

    monkeypatch.setattr(rt.table, "get", get)  # the conversations' part: where a step looks it up
    monkeypatch.setattr(rt.materializer, "cancel", cancel)
    try:
        rt.delete_conversation(cid)
        sender.join(timeout=60)
        assert not sender.is_alive()
    finally:
        monkeypatch.undo()
        resurrected = cid in rt.engine.tree.chains
        if resurrected:
            rt.engine.release(cid)  # keep the shared runtime consistent for later tests
    assert not resurrected, "a deleted conversation holds a locked chain again"
    assert len(outcome) == 1 and isinstance(outcome[0], ConversationNotFound)
