"""Attention backends: the paged reference (flashinfer's semantics in torch, fed
the same page metadata as flashinfer) against SDPA through the real engine and
SGLang's pools, the page-metadata builder, and how a backend is chosen."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from session_runtime.config import PRESETS, RuntimeConfig
from session_runtime.model.attention import (
    AttentionUnavailable,
    PagedReferenceAttention,
    SdpaAttention,
    make_attention,
    paged_metadata,
)
from session_runtime.model.weights import random_decoder
from tests.session_runtime.test_oracle import VOCAB, make_engine, rand_ids, rel_err, step


@pytest.fixture(scope="module")
def tiny_decoder():
    # The tiny shape with the oracle tests' 1000-token vocabulary: the test ids
    # are below 1000, and a 129k-row lm_head would dominate the run time.
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB)
    return random_decoder(cfg, seed=5, dtype=torch.float32, device="cpu")


def run_scenario(dec, backend, page_size: int) -> list[torch.Tensor]:
    """Cold prefill of 37 tokens, then 20 more after the cached prefix, decoding 5.
    Chunks of 24 make forwards that start and end mid-page too."""
    dec.set_attention(backend)
    try:
        engine = make_engine(dec, page_size, prefill_chunk=24)
        first = rand_ids(37, seed=21)  # ends mid-page at page size 16
        cold = step(engine, first)
        warm = step(engine, first + rand_ids(20, seed=22), max_tokens=5)
        engine.check_integrity()
    finally:
        dec.set_attention(SdpaAttention())
    # The conversation's own continuation reuses its private partial last page
    # too: the warm step starts mid-page (position 37) at page size 16.
    cached = 37
    assert warm.accounting.cached_input_tokens == cached
    assert warm.logits.shape[0] == 57 - cached + 4  # the suffix, then 4 fed decode tokens
    return [cold.logits, warm.logits]


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_reference_matches_sdpa(tiny_decoder, page_size):
    sdpa = run_scenario(tiny_decoder, SdpaAttention(), page_size)
    paged = run_scenario(tiny_decoder, PagedReferenceAttention(), page_size)
    for ours, ref in zip(paged, sdpa):
        assert rel_err(ours, ref) < 1e-5


def test_paged_metadata_of_hand_made_slots():
    # Page size 4: pages 2, 0, then 2 tokens of page 5.
    meta = paged_metadata(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 20, 21]), q_len=3, page_size=4)
    assert meta.page_size == 4
    assert meta.qo_indptr.tolist() == [0, 3]
    assert meta.kv_indptr.tolist() == [0, 3]
    assert meta.kv_indices.tolist() == [2, 0, 5]
    assert meta.kv_last_page_len.tolist() == [2]
    assert {t.dtype for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)} == {torch.int32}


@pytest.mark.parametrize("slots", [[8, 9, 11, 12], [1, 2, 3, 4, 5], [4, 5, 6, 7, 9]])
def test_paged_metadata_rejects_slots_that_are_not_whole_pages(slots):
    with pytest.raises(ValueError, match="not page-contiguous"):
        paged_metadata(torch.tensor(slots), q_len=1, page_size=4)


def test_auto_on_cpu_is_sdpa_without_importing_flashinfer():
    code = (
        "import sys, torch\n"
        "from session_runtime.config import PRESETS\n"
        "from session_runtime.model.attention import make_attention\n"
        "backend = make_attention('auto', PRESETS['tiny'], torch.float32, 'cpu')\n"
        "print(backend.name, 'flashinfer' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["sdpa", "False"]


def test_backend_names():
    cfg = PRESETS["tiny"]
    assert make_attention("sdpa", cfg, torch.float32, "cpu").name == "sdpa"
    assert make_attention("paged-reference", cfg, torch.float32, "cpu").name == "paged-reference"
    with pytest.raises(AttentionUnavailable, match="cuda only"):
        make_attention("flashinfer", cfg, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="attention must be one of"):
        make_attention("flash", cfg, torch.float32, "cpu")


def test_bad_attention_in_config_is_rejected():
    with pytest.raises(ValueError, match="attention must be one of"):
        RuntimeConfig(attention="flash")
