"""No model, only its shape: for `replay --no-model`.

A replay forces every output token, so which tokens a step computes, reuses,
holds, frees and offloads depends only on the tokens, the page size and the
pool: never on the values the model would write. `TokenOnlyDecoder` stands
where the decoder stands in the embedded engine. Its shape sizes the pools as
the model's would (so the KV byte figures are the model's), it writes no KV
and returns zero logits, and the engine refuses a step that would sample.
The tree, the chains, the private pages, the host tier, the materializer and
the accounting all run as they do with the model: the same numbers, token for
token (tests/session_runtime/test_replay_no_model.py).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from session_runtime.config import PRESETS, ModelConfig, RuntimeConfig
from session_runtime.errors import InvalidRequest


class TokenOnlyDecoder:
    """The decoder's interface with no weights and no compute."""

    samples = False  # the engine refuses a step that is not forced
    attention = SimpleNamespace(name="none (no model)")

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._logits = torch.zeros(1, cfg.vocab_size)

    def __call__(self, input_ids: torch.Tensor, positions, out_slots, ctx_slots, kv_pool,
                 all_logits: bool = False) -> torch.Tensor:
        return self._logits.expand(len(input_ids), -1) if all_logits else self._logits


def token_only_for(config: RuntimeConfig, min_vocab: int = 0) -> TokenOnlyDecoder:
    """The configured model's shape (a preset's, or a folder's config.json) without its weights."""
    from session_runtime.model.weights import config_from_hf

    if config.model in PRESETS:
        cfg = PRESETS[config.model]
    elif (Path(config.model) / "config.json").exists():
        cfg = config_from_hf(Path(config.model))
    else:
        raise InvalidRequest(f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
                             f"folder with config.json (cwd {os.getcwd()})")
    return TokenOnlyDecoder(dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, min_vocab)))
