"""A DeepSeek-V3-architecture model folder for the MLA tests: random weights
saved by transformers (`DeepseekV3ForCausalLM`), every layer dense, yarn rope
scaling, DeepSeek's vocabulary (the `deepseek` template needs every id).

SGLang reads a few keys transformers 5 no longer writes: `rope_scaling` (its
CPU rope asserts yarn's parameters there) and the MoE keys DeepSeek-V3's own
config.json carries (`moe_layer_freq`, `topk_method`, `scoring_func`, ...);
they are added to config.json after saving (`../shared/SGLANG_NOTES.md`)."""

from __future__ import annotations

import json
from pathlib import Path

# kv_lora_rank + qk_rope_head_dim = 80 latent values per token and layer.
SHAPE = dict(vocab_size=129280, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
             n_routed_experts=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32,
             qk_nope_head_dim=32, n_group=1, topk_group=1, num_experts_per_tok=2, max_position_embeddings=4096)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
ROPE_THETA = 10000.0


def latent_width() -> int:
    return SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]


def write_folder(folder: Path, seed: int = 1) -> Path:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**SHAPE, first_k_dense_replace=SHAPE["num_hidden_layers"], tie_word_embeddings=False,
                           rope_parameters={**YARN, "rope_theta": ROPE_THETA}, rope_interleave=True)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # scaled up from HF's init, as tests/conftest.py `_hf_model` does
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config.update(rope_scaling={**YARN, "type": "yarn"}, rope_theta=ROPE_THETA, moe_layer_freq=1,
                  topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True)
    path.write_text(json.dumps(config, indent=1))
    return Path(folder)
