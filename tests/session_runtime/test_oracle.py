"""Engine logits and greedy tokens against `transformers` (the correctness oracle).

Our Decoder loads a transformers state dict as is; the Engine runs it over
SGLang's paged pools and our radix tree. Every computed position's float32
logits must match the HF model run over the whole sequence (relative max error
< 1e-4), whether the prefix came from the tree, the prompt was chunked, or the
tokens were decoded one at a time.
"""

from __future__ import annotations

import pytest
import torch

from radix_ext.tree import Namespace
from session_runtime.config import RuntimeConfig
from session_runtime.backends.embedded.engine import Engine, StepRequest
from session_runtime.sampling import SamplingParams

NS = Namespace(extra_key="t")
ARCHS = ["qwen3", "llama"]
VOCAB = 1000
REL_TOL = 1e-4


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float((ours - ref).abs().max() / ref.abs().max())


def make_engine(dec, page_size: int, **kw) -> Engine:
    return Engine(RuntimeConfig(page_size=page_size, pool_tokens=1024, max_context=256, **kw), dec)


def step(engine, prompt, owner="a", max_tokens=1, forced=None, logprobs=False):
    return engine.step(
        StepRequest(
            owner=owner, prompt=prompt, namespace=NS,
            sampling=SamplingParams(max_tokens=max_tokens, logprobs=logprobs),
            forced=forced, return_logits=True,
        )
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_cold_prefill_matches_hf(oracle_pairs, arch, page_size):
    hf, dec = oracle_pairs[arch]
    engine = make_engine(dec, page_size)
    ids = rand_ids(37, seed=1)
    res = step(engine, ids)
    ref = hf_logits(hf, ids)

    assert res.accounting.cached_input_tokens == 0
    assert res.accounting.uncached_prefill_tokens == 37
    assert res.logits.dtype == torch.float32
    assert res.logits.shape == (37, VOCAB)
    assert rel_err(res.logits, ref) < REL_TOL
    assert res.output == [int(ref[-1].argmax())]
    assert res.finish_reason == "length"
    # The one sampled token was never fed: the computed sequence is the prompt.
    assert res.sequence == ids
    assert engine.tree.chain_tokens("a") == 37  # the partial last page stays private
    assert res.accounting.kv_device_bytes == engine.tree.chain_tokens("a") * 2 * 2 * 2 * 32 * 4
    engine.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_reuse_computes_only_the_suffix(oracle_pairs, arch, page_size):
    hf, dec = oracle_pairs[arch]
    engine = make_engine(dec, page_size)
    # Ends mid-page for page 16: 32 tokens in the tree, the last 5 in the chain's
    # private page (a whole page of the pool), which its own next step reuses.
    first = rand_ids(37, seed=2)
    step(engine, first)
    free_before = engine.pools.allocator.available_size()
    assert free_before == engine.pools.capacity - (37 if page_size == 1 else 48)

    full = first + rand_ids(20, seed=3)  # 57 tokens
    res = step(engine, full)
    m = 37
    acc = res.accounting
    assert acc.prompt_tokens == 57
    assert acc.cached_input_tokens == m
    assert acc.uncached_prefill_tokens == 57 - m
    assert acc.logical_reusable_tokens == m
    assert acc.alignment_loss_tokens == 0
    assert res.logits.shape == (57 - m, VOCAB)
    ref = hf_logits(hf, full)
    assert rel_err(res.logits, ref[m:]) < REL_TOL
    assert res.output == [int(ref[-1].argmax())]
    assert engine.tree.chain_tokens("a") == 57
    # The step wrote on into the private page (now a tree page) and holds a new one.
    assert engine.pools.allocator.available_size() == engine.pools.capacity - (57 if page_size == 1 else 64)
    engine.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_divergence_mid_page_reuses_whole_pages_only(oracle_pairs, arch):
    """A prompt that leaves a cached 48-token sequence after 37 tokens: 37 are
    logically reusable, 32 physically (page 16), 5 lost to alignment."""
    hf, dec = oracle_pairs[arch]
    engine = make_engine(dec, 16)
    base = rand_ids(48, seed=4)
    step(engine, base, owner="a")
    other = base[:37] + [(base[37] + 1) % VOCAB] + rand_ids(12, seed=5)  # 50 tokens
    res = step(engine, other, owner="b")
    acc = res.accounting
    assert (acc.cached_input_tokens, acc.logical_reusable_tokens, acc.alignment_loss_tokens) == (32, 37, 5)
    assert rel_err(res.logits, hf_logits(hf, other)[32:]) < REL_TOL
    # a's 48 tokens and b's first 48 share the first two pages: 32 + 16 + 16 cached,
    # plus b's private page holding its last 2 tokens.
    assert engine.tree.chain_tokens("a") == 48 and engine.tree.chain_tokens("b") == 50
    assert engine.pools.capacity - engine.pools.allocator.available_size() == 80
    engine.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_matches_hf(oracle_pairs, arch, page_size):
    hf, dec = oracle_pairs[arch]
    engine = make_engine(dec, page_size)
    prompt = rand_ids(21, seed=6)
    res = step(engine, prompt, max_tokens=12, logprobs=True)
    assert len(res.output) == 12 and res.finish_reason == "length"
    fed = prompt + res.output[:-1]  # the last token is sampled but never fed
    assert res.sequence == fed
    ref = hf_logits(hf, fed)
    # Logits: the 21 prompt positions, then one row per fed decode token (11).
    assert res.logits.shape == (32, VOCAB)
    assert rel_err(res.logits, ref) < REL_TOL
    assert res.output == ref[20:].argmax(-1).tolist()
    ref_lp = torch.log_softmax(ref[20:], -1)
    expected_lp = [float(ref_lp[i, t]) for i, t in enumerate(res.output)]
    assert res.logprobs == pytest.approx(expected_lp, abs=1e-4)
    assert engine.tree.chain_tokens("a") == 32  # 21 + 11 fed: two whole pages either way
    engine.check_integrity()

    # Continue from the decoded sequence: its KV (written during decode) is reused.
    nxt = fed + [res.output[-1]] + rand_ids(9, seed=7)  # 42 tokens
    res2 = step(engine, nxt, max_tokens=3)
    assert res2.accounting.cached_input_tokens == 32  # 32 computed, aligned either way
    ref2 = hf_logits(hf, nxt + res2.output[:-1])
    assert rel_err(res2.logits, ref2[32:]) < REL_TOL
    assert res2.output == ref2[41:].argmax(-1).tolist()
    engine.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_forced_tokens_logits_and_logprobs(oracle_pairs, arch, page_size):
    hf, dec = oracle_pairs[arch]
    engine = make_engine(dec, page_size)
    prompt, forced = rand_ids(19, seed=8), rand_ids(15, seed=9)
    res = step(engine, prompt, forced=forced, logprobs=True)
    assert res.output == forced and res.finish_reason == "forced"
    assert res.sequence == prompt + forced  # forced tokens are all fed
    ref = hf_logits(hf, prompt + forced)
    assert res.logits.shape == (34, VOCAB)
    assert rel_err(res.logits, ref) < REL_TOL
    lp = torch.log_softmax(ref[18:33], -1)
    assert res.logprobs == pytest.approx([float(lp[i, t]) for i, t in enumerate(forced)], abs=1e-4)
    assert engine.tree.chain_tokens("a") == 34  # 32 in the tree + 2 in the private page
    engine.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_unchunked(oracle_pairs, arch):
    hf, dec = oracle_pairs[arch]
    whole = make_engine(dec, 16)
    chunked = make_engine(dec, 16, prefill_chunk=8)
    first = rand_ids(37, seed=10)
    full = first + rand_ids(30, seed=11)
    forced = rand_ids(13, seed=12)
    (w1, w2), (c1, c2) = ([step(e, first), step(e, full, forced=forced)] for e in (whole, chunked))
    ref = hf_logits(hf, full + forced)
    assert c1.logits.shape == (37, VOCAB)
    assert rel_err(c1.logits, w1.logits) < 1e-5
    assert rel_err(c1.logits, ref[:37]) < REL_TOL
    # Second step: 37 cached (the chain's private page too), 30 prompt tokens in
    # chunks of 8 (the first starts mid-page), then 13 forced in chunks of 8.
    assert c2.accounting.cached_input_tokens == w2.accounting.cached_input_tokens == 37
    assert c2.logits.shape == (67 - 37 + 13, VOCAB)
    assert rel_err(c2.logits, w2.logits) < 1e-5
    assert rel_err(c2.logits, ref[37:]) < REL_TOL
    assert c1.output == w1.output and c2.output == w2.output
    assert chunked.tree.chain_tokens("a") == whole.tree.chain_tokens("a") == 80
    whole.check_integrity()
    chunked.check_integrity()
