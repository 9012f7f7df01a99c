"""Qwen3/Llama decoder in torch whose attention reads and writes SGLang's KV pool.

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`,
...), so a `transformers` state dict loads as is and is the correctness oracle.
One call runs one sequence chunk: q new tokens at given positions, whose K/V
go to `out_slots`, attending over `ctx_slots` (the whole context, new tokens
last). How attention reads the pool is a pluggable backend (`model/attention.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from session_runtime.config import ModelConfig
from session_runtime.model.attention import AttentionBackend, SdpaAttention
from session_runtime.model.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers: normalise in float32, cast, then scale.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rope:
    """Rotary embedding tables (rotate-half convention, as transformers)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [q, heads, dim]; cos/sin: [q, dim]
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, batch: "ForwardBatch", attention: AttentionBackend) -> torch.Tensor:
        q_len = x.shape[0]
        q = self.q_proj(x).view(q_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(q_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(q_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        pool = batch.kv_pool
        pool.set_kv_buffer(None, batch.out_slots, k, v, layer_id_override=self.layer_id)
        out = attention.attend(q, pool.get_key_buffer(self.layer_id), pool.get_value_buffer(self.layer_id))
        return self.o_proj(out.reshape(q_len, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, batch, attention) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """The full model. `forward` writes K/V of the new tokens into the pool."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: Rope | None = None
        self.attention: AttentionBackend = SdpaAttention()

    def set_attention(self, backend: AttentionBackend) -> None:
        """Use `backend` for every later forward (SDPA until then)."""
        self.attention = backend

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        ctx_slots: torch.Tensor,
        kv_pool,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run q tokens; returns float32 logits [q, vocab] (or [1, vocab] for the last)."""
        if self._rope is None:
            self._rope = Rope(self.cfg.head_dim, self.cfg.rope_theta, input_ids.device)
        batch = ForwardBatch(kv_pool, positions, out_slots, ctx_slots)
        self.attention.begin(batch)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._rope.cos_sin(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, self.attention)
        if not all_logits:
            h = h[-1:]
        return self.lm_head(self.model.norm(h)).float()
