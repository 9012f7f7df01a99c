"""Shared, session-scoped fixtures.

Importing SGLang costs ~18 s per process, so the whole suite runs in one pytest
process and the expensive objects (the HF oracle models, the tiny Runtime) are
built once here.
"""

from __future__ import annotations

import pytest
import torch

from session_runtime.config import ModelConfig

# The small shape the oracle and engine tests use (the brief's Qwen3/Llama shape).
SMALL_SHAPE = dict(
    vocab_size=1000, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=32, intermediate_size=256, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def small_model_config(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, **SMALL_SHAPE)


# The tiny preset's shape with the bundled DeepSeek tokenizer's vocabulary: the
# model folder the SGLang-backend tests serve (templates need every token id).
TINY_SHAPE = dict(
    vocab_size=129280, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=64, intermediate_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _hf_model(arch: str, seed: int, shape: dict = SMALL_SHAPE):
    """A transformers model of `shape` with seeded random weights, scaled up
    from HF's std-0.02 init so attention is far from uniform and the argmax
    is decisive (a weak init would hide masking/position bugs)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls_cfg, cls_model = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    s = shape
    cfg = cls_cfg(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
        intermediate_size=s["intermediate_size"], rope_theta=s["rope_theta"], rms_norm_eps=s["rms_norm_eps"],
        tie_word_embeddings=True, attn_implementation="eager",
        **({"max_position_embeddings": s["max_position_embeddings"]} if "max_position_embeddings" in s else {}),
    )
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)  # in [0.5, 1.5): norms must be applied
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="session")
def oracle_pairs():
    """{arch: (transformers model, our Decoder with the same weights)}."""
    from session_runtime.model.decoder import Decoder

    pairs = {}
    for i, arch in enumerate(("qwen3", "llama")):
        hf = _hf_model(arch, seed=1234 + i)
        dec = Decoder(small_model_config(arch))
        dec.load_state_dict(hf.state_dict())
        dec.eval()
        assert dec.lm_head.weight.data_ptr() == dec.model.embed_tokens.weight.data_ptr()
        pairs[arch] = (hf, dec)
    return pairs


@pytest.fixture(scope="session")
def small_decoder():
    """A seeded random qwen3 decoder of SMALL_SHAPE (vocab 1000) for engine tests
    that do not need the oracle."""
    from session_runtime.model.weights import random_decoder

    return random_decoder(small_model_config("qwen3"), seed=7, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def tiny_runtime():
    """One Runtime over the 'tiny' preset, shared by the runtime tests (each test
    makes its own conversations). No background materializer: deterministic."""
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    rt = Runtime(RuntimeConfig(model="tiny", pool_tokens=16384, max_context=256), background=False)
    yield rt
    rt.close()


# ----- the SGLang backend ------------------------------------------------------
# One SGLang server per test session (a start costs about 70 CPU-seconds and
# 4-5 GB): every SGLang-backend test shares it, each with its own conversations.
# When it cannot start here the tests that need it fail: they never skip.

SGLANG_POOL = 2048
SGLANG_CONTEXT = 4096


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory):
    """The tiny shape with DeepSeek's vocabulary, saved by transformers as a
    Hugging Face folder (random weights, scaled as in `_hf_model`), whose own
    context limit (max_position_embeddings) is SGLANG_CONTEXT: the runtimes
    over it are given no max_context and take the model's."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    model = _hf_model("qwen3", seed=4321, shape={**TINY_SHAPE, "max_position_embeddings": SGLANG_CONTEXT})
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _folder_runtime(folder, backend: str):
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    # No max_context: the folder's own limit (SGLANG_CONTEXT) is the default on both backends.
    return Runtime(RuntimeConfig(model=str(folder), backend=backend, page_size=16, pool_tokens=SGLANG_POOL,
                                 template="deepseek", data_dir=None, offload="never"),
                   background=False)


@pytest.fixture(scope="session")
def sglang_runtime(tiny_hf_folder):
    """A Runtime on SGLang's real server (launched by the runtime), serving
    `tiny_hf_folder`; pool 2048 tokens, context 4096, page 16."""
    rt = _folder_runtime(tiny_hf_folder, "sglang")
    yield rt
    rt.close()


@pytest.fixture
def sglang_rt(sglang_runtime):
    """`sglang_runtime` for one test: every conversation it made is deleted
    after it, and the tree's integrity checked."""
    yield sglang_runtime
    for cid in list(sglang_runtime.conversations):
        sglang_runtime.delete_conversation(cid)
    sglang_runtime.check_integrity()


@pytest.fixture(scope="session")
def embedded_twin(tiny_hf_folder):
    """The embedded engine over the same folder and sizes as `sglang_runtime`."""
    rt = _folder_runtime(tiny_hf_folder, "embedded")
    yield rt
    rt.close()


# ----- PostgreSQL --------------------------------------------------------------
# One server per test session (tests/postgres.py); each test that asks for a
# store gets a fresh database on it.

@pytest.fixture(scope="session")
def postgres():
    from tests.postgres import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres):
    return postgres.new_database()
