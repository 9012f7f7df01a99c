"""Save a random-weight preset as a Hugging Face folder (config.json plus
safetensors), so that SGLang's server can load the same model our embedded
engine runs. Written once per (preset, seed, vocabulary); reused afterwards."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from session_runtime.config import PRESETS, ModelConfig


def hf_config(cfg: ModelConfig) -> dict:
    """transformers' config.json for a ModelConfig."""
    arch = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}[cfg.arch]
    return {
        "architectures": [arch[0]], "model_type": arch[1], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
    }


def export_preset(name: str, seed: int, folder: Path, min_vocab: int = 0) -> Path:
    """Write preset `name` with the weights `random_decoder(seed)` gives into
    `folder/<name>-seed<seed>-v<vocab>` unless it is there already. Returns that
    folder. The write goes to a temporary folder first, then is renamed, so a
    crash never leaves half a model."""
    import torch
    from safetensors.torch import save_file

    from session_runtime.model.weights import random_decoder

    cfg = PRESETS[name]
    cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, min_vocab))
    out = folder / f"{name}-seed{seed}-v{cfg.vocab_size}"
    if (out / "model.safetensors").exists():
        return out
    tmp = folder / f".{out.name}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    decoder = random_decoder(cfg, seed, torch.float32, "cpu")
    state = {k: v.contiguous() for k, v in decoder.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return out
