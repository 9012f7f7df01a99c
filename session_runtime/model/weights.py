"""Build a Decoder: random weights for a preset, or real weights from a local
Hugging Face folder (config.json + *.safetensors). Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from session_runtime.config import PRESETS, ModelConfig, RuntimeConfig
from session_runtime.errors import InvalidRequest
from session_runtime.model.attention import make_attention
from session_runtime.model.decoder import Decoder

_ARCHS = {"qwen3": "qwen3", "llama": "llama"}


def config_from_hf(folder: Path) -> ModelConfig:
    """Read a transformers config.json into a ModelConfig. Raises InvalidRequest."""
    raw = json.loads((folder / "config.json").read_text())
    arch = _ARCHS.get(raw.get("model_type", ""))
    if arch is None:
        raise InvalidRequest(f"unsupported model_type {raw.get('model_type')!r}: qwen3 or llama")
    if raw.get("rope_scaling") not in (None, {}):
        raise InvalidRequest(f"rope_scaling {raw['rope_scaling']!r} is not supported")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
    )


def random_decoder(cfg: ModelConfig, seed: int, dtype: torch.dtype, device: str) -> Decoder:
    """A decoder with seeded random weights (normal, std 0.02; norms at 1), as
    transformers initialises them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Decoder(cfg)
    model = model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def load_hf_decoder(folder: Path, dtype: torch.dtype, device: str) -> Decoder:
    """Load real weights from a local folder. Raises InvalidRequest on mismatch."""
    from safetensors.torch import load_file

    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Decoder(cfg)
    state: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"no *.safetensors in {folder}")
    for f in files:
        state.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing:
        raise InvalidRequest(f"weights missing from {folder}: {missing[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def build_decoder(model: str, seed: int, dtype: torch.dtype, device: str, min_vocab: int = 0) -> Decoder:
    """A preset name gives random weights (the vocabulary widened to `min_vocab`
    so every tokenizer id has a row); an existing folder gives its weights."""
    if model in PRESETS:
        cfg = PRESETS[model]
        return random_decoder(dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, min_vocab)), seed, dtype, device)
    folder = Path(model)
    if folder.is_dir() and (folder / "config.json").exists():
        return load_hf_decoder(folder, dtype, device)
    raise InvalidRequest(
        f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
        f"folder with config.json (cwd {os.getcwd()})"
    )


def decoder_for(config: RuntimeConfig, min_vocab: int = 0) -> Decoder:
    """The configured model (`build_decoder`) with its attention backend."""
    decoder = build_decoder(config.model, config.seed, config.torch_dtype, config.device, min_vocab)
    decoder.set_attention(make_attention(config.attention, decoder.cfg, config.torch_dtype, config.device))
    return decoder
