"""Token work priced for a model shape: FLOPs and bytes (the replay's economics
and the `auto` policy both price with it; it imports neither).

- FLOPs: 2 * N * tokens for the linear layers (N: the non-embedding weights:
  q, k, v, o projections and the gated MLP of every layer; norms left out), plus
  4 * layers * q_heads * head_dim * context for attention (QK^T and AV, per
  token), plus 2 * hidden * vocab for each logits row (one per generated token;
  materialization computes none);
- bytes: weights read once per forward (N, plus the LM head when it computes
  logits), at `dtype`; a step's forwards are ceil(q / prefill_chunk) prefill
  chunks and n - 1 decodes (its first token comes from the prefill's logits);
  KV read: each decode token reads its context, each prefill chunk reads the KV
  of everything up to its end once; KV written: every computed token once. KV
  bytes per token: 2 * layers * kv_heads * head_dim * element size;
"""

from __future__ import annotations

import math
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from session_runtime.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}



@dataclass(frozen=True)
class CostModel:
    """A model shape priced per token; `dtype` sets weight and KV element size."""

    name: str
    shape: "ModelConfig"
    dtype: str = "bfloat16"
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"cost dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def non_embedding_params(self) -> int:
        s = self.shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return s.num_layers * (s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.shape.hidden_size * self.shape.vocab_size

    @property
    def attention_flops_per_context(self) -> int:
        return 4 * self.shape.num_layers * self.shape.num_heads * self.shape.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.element_bytes

    def describe(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "prefill_chunk": self.prefill_chunk,
                "non_embedding_params": self.non_embedding_params, "lm_head_params": self.lm_head_params,
                "kv_bytes_per_token": self.kv_bytes_per_token, **asdict(self.shape)}


def cost_model(name: str, dtype: str = "bfloat16", prefill_chunk: int = 2048) -> CostModel:
    """A preset of config.PRESETS, or a local Hugging Face folder's config.json.
    Raises ValueError."""
    from session_runtime.config import PRESETS

    if name in PRESETS:
        return CostModel(name, PRESETS[name], dtype, prefill_chunk)
    folder = Path(name)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--cost-model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a local folder "
                         "with config.json")
    from session_runtime.errors import InvalidRequest
    from session_runtime.model.weights import config_from_hf

    try:
        shape = config_from_hf(folder)
    except (InvalidRequest, KeyError, ValueError) as exc:
        raise ValueError(f"--cost-model {name!r}: {exc}") from None
    return CostModel(folder.name, shape, dtype, prefill_chunk)


@dataclass(frozen=True)
class Work:
    """Token work of some steps or materializations, before pricing."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_attention: int = 0  # sum of context over prefilled tokens
    decode_attention: int = 0  # sum of context over generated tokens
    forwards: int = 0  # weight reads
    logits_rows: int = 0
    kv_read_tokens: int = 0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def flops(self, cm: CostModel) -> int:
        tokens = self.prefill_tokens + self.decode_tokens
        return (2 * cm.non_embedding_params * tokens
                + cm.attention_flops_per_context * (self.prefill_attention + self.decode_attention)
                + 2 * cm.lm_head_params * self.logits_rows)

    def bytes(self, cm: CostModel) -> int:
        """Weights read (N per forward, the LM head once per logits row: the
        prefill's last chunk and each decode forward) plus KV read and written."""
        weights = self.forwards * cm.non_embedding_params + self.logits_rows * cm.lm_head_params
        written = self.prefill_tokens + self.decode_tokens
        return weights * cm.element_bytes + (self.kv_read_tokens + written) * cm.kv_bytes_per_token

    def priced(self, cm: CostModel) -> dict:
        return {**asdict(self), "flops": self.flops(cm), "bytes": self.bytes(cm)}


def prefill_work(q: int, reused: int, chunk: int) -> Work:
    """q tokens prefilled on `reused` ones, in chunks of `chunk` (no logits)."""
    if q <= 0:
        return Work()
    chunks = math.ceil(q / chunk)
    read = sum(reused + min(q, (c + 1) * chunk) for c in range(chunks))
    return Work(prefill_tokens=q, prefill_attention=q * reused + q * (q + 1) // 2, forwards=chunks,
                kv_read_tokens=read)


def decode_work(n: int, context: int) -> Work:
    """n generated tokens after a prompt of `context` tokens: n - 1 decode
    forwards, n logits rows, the i-th token attending to context + i + 1."""
    if n <= 0:
        return Work()
    attention = n * context + n * (n + 1) // 2
    return Work(decode_tokens=n, decode_attention=attention, forwards=n - 1, logits_rows=n, kv_read_tokens=attention)


# What the default price of a KV token-second assumes: one GPU-second of compute
# is worth as much as holding the GPU's whole memory for that second. An H100
# SXM: 989 TFLOP/s dense bf16 peak, run at 40% of it; 80 GB of HBM.
GPU_FLOPS_PER_S = 0.4 * 989e12
GPU_MEMORY_BYTES = 80e9
KV_PRICE_ASSUMES = ("one H100-second of compute (40% of 989 TFLOP/s bf16) costs as much as holding its "
                    "80 GB of HBM for a second")


def default_kv_price(cm: CostModel) -> float:
    """FLOPs one KV token-second is worth, by KV_PRICE_ASSUMES, for `cm`'s KV bytes per token."""
    return GPU_FLOPS_PER_S * cm.kv_bytes_per_token / GPU_MEMORY_BYTES
