"""Frozen configuration: model shapes, presets and the runtime settings.

Built once (from CLI flags or code) and passed down; nothing reads globals.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from session_runtime.direct_http import check_url

if TYPE_CHECKING:
    import torch

# The bundled DeepSeek tokenizer has 129280 ids; random presets are sized so
# every id, special tokens included, has an embedding row.
DEEPSEEK_VOCAB = 129280


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3/Llama-family decoder."""

    arch: str  # "qwen3" (QK-norm) or "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token over all layers."""
        import torch

        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


PRESETS: dict[str, ModelConfig] = {
    # CPU tests: a few layers, hidden 256; the whole suite runs in seconds.
    "tiny": ModelConfig(
        arch="qwen3", vocab_size=DEEPSEEK_VOCAB, hidden_size=256, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
    ),
    # Llama 3's own vocabulary (128256) is smaller than the bundled tokenizer's.
    "llama3-8b": ModelConfig(
        arch="llama", vocab_size=DEEPSEEK_VOCAB, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        rope_theta=500_000.0, rms_norm_eps=1e-5,
    ),
}

# torch's dtype of each name; torch is imported where a dtype is needed, so the
# CLI can parse and check its flags without it.
DTYPES = ("float32", "bfloat16", "float16")
# auto: flashinfer on cuda where it runs, else torch SDPA (see model/attention.py).
ATTENTION_BACKENDS = ("auto", "sdpa", "flashinfer", "paged-reference")
BACKENDS = ("embedded", "sglang", "upstream")
UPSTREAM_PROTOCOLS = ("deepseek", "openai-chat", "openai-responses", "anthropic", "gemini")


DEFAULT_CONTEXT = 32768  # a model whose limit is not known here (upstream mode)


def model_context_limit(model: str) -> Optional[int]:
    """max_position_embeddings of a preset, or of a local folder's config.json;
    None when neither says."""
    if model in PRESETS:
        return PRESETS[model].max_position_embeddings
    import json
    from pathlib import Path

    try:
        raw = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("max_position_embeddings") if isinstance(raw, dict) else None
    return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the runtime needs to build its engine, tree and pools."""

    model: str = "tiny"  # a preset name or a local Hugging Face folder
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "auto"  # one of ATTENTION_BACKENDS
    # False: the embedded engine runs no model, only its shape (replay --no-model:
    # every step forced; a step that would sample is refused).
    run_model: bool = True
    page_size: int = 16
    pool_tokens: int = 65536
    # Host-tier capacity for offloaded KV; None: 4x pool_tokens, at most a
    # quarter of host memory. Allocated once (pinned on CUDA).
    host_pool_tokens: Optional[int] = None
    # The longest sequence a step may reach; None: the model's own limit
    # (max_position_embeddings of the preset or folder; what a given SGLang
    # server derives, when smaller). A larger value than the model's is refused.
    max_context: Optional[int] = None
    context_from_model: bool = False  # set when max_context was left out (a server's smaller limit may lower it)
    # The most tokens one step may generate (a request asking more is refused);
    # None: the context. Never more than the context.
    max_tokens_limit: Optional[int] = None
    max_running: int = 4  # rows of the ReqToTokenPool: steps in flight at once
    prefill_chunk: int = 2048  # tokens per prefill forward (bounds attention memory)
    seed: int = 0
    policy: str = "drop"  # default reasoning policy of new conversations
    # Policy auto prices each turn's choice as the replay's verdict does
    # (replay/economics.py): for this model shape (a preset or a folder with
    # config.json; None: `model`'s), in this element type, with a KV
    # token-second worth `kv_price` FLOPs (None: economics' default price).
    cost_model: Optional[str] = None
    cost_dtype: str = "bfloat16"
    kv_price: Optional[float] = None
    # Default chat template of new conversations: deepseek, qwen3, or auto (qwen3
    # when a model folder's tokenizer is Qwen's, deepseek otherwise).
    template: str = "auto"
    offload: str = "pressure"  # default tool-wait offload policy: never, always, ttl, pressure
    # A closed conversation idle this long is demoted to the host tier (or, with
    # the host full, released to LRU); under pressure idle chains go first. 0: never.
    idle_ttl_s: float = 300.0
    data_dir: Optional[str] = None  # SQLite store of conversations; None keeps them in memory
    # A PostgreSQL URL: conversations kept there instead of data_dir's SQLite file
    # (the data folder still holds the server secret and stored responses).
    store: Optional[str] = None
    # With `store`: the URL the other runtime processes over the same store reach
    # this one at (store/fleet.py); set, this process joins them. A member silent for
    # member_ttl_s is gone: the others take its conversations over.
    advertise_url: Optional[str] = None
    member_ttl_s: float = 3.0
    # With a store: conversations kept in memory at once; past it the least
    # recently used idle ones leave memory and are read back at their next use. 0: no bound.
    max_resident_conversations: int = 4096
    model_id: str = ""  # namespace override; defaults to the model name
    # The names clients may ask for (--served-model-name), the first the one
    # answers carry; empty: the model's id alone. The namespace stays model_id's.
    served_model_names: tuple[str, ...] = ()
    # An inferred conversation (a stateless client's, matched by its history)
    # with no request for this long is deleted; its chain retires earlier, as
    # every idle conversation's does. 0: never.
    session_idle_ttl_s: float = 86400.0
    # "embedded" (our engine, in process) or "sglang" (SGLang's own server,
    # launched as a child process group, or reached at sglang_url).
    backend: str = "embedded"
    # Running servers with --radix-cache-backend session: one URL, or several
    # separated by commas (each a worker).
    sglang_url: Optional[str] = None
    # SGLang workers the runtime launches; None: one unless sglang_url names servers.
    workers: Optional[int] = None
    placement_epsilon: float = 0.25  # no worker above (1 + epsilon) x the mean load
    # A running sglang-router over the workers, for stateless steps (requests
    # without a conversation); None with several workers: the runtime launches one.
    router_url: Optional[str] = None
    sglang_args: tuple[str, ...] = ()  # extra flags for a launched SGLang server
    sglang_max_running: int = 32  # --max-running-requests of a launched server
    # SGLang's --api-key: sent with every request and command; passed to a
    # launched server. None: SGLANG_API_KEY from the environment, if set.
    sglang_api_key: Optional[str] = None
    tp_size: int = 1  # tensor-parallel ranks of a launched server (a given one's are read from it)
    # SGLang holds a conversation's chain under this runtime's lease, renewed by
    # its steps and a heartbeat; past it (the runtime is gone) the chains go back
    # to the LRU. 0: no lease (chains stay until released: unsafe if the runtime dies).
    chain_lease_s: float = 300.0
    request_deadline_s: float = 600.0  # a step still running after this fails (408) and changes nothing; 0: none
    max_conversations_per_tenant: int = 10000  # a tenant's conversations the server keeps; 0: no limit
    max_tenant_bytes: int = 1 << 30  # bytes of conversations (as stored) a tenant may hold; 0: no limit
    max_tools: int = 128  # tools of one conversation; 0: no limit
    max_tools_bytes: int = 256 * 1024  # bytes of one conversation's tools, as JSON; 0: no limit
    # Upstream proxy mode (backend "upstream"): steps are answered by a provider's
    # API at upstream_url (its SDK's base_url: OpenAI-style up to and including
    # /v1, Anthropic's without), spoken in upstream_protocol.
    upstream_url: Optional[str] = None
    upstream_protocol: str = "deepseek"
    upstream_model: Optional[str] = None  # the model name sent upstream; None: the request's, else model_id
    upstream_timeout_s: float = 600.0
    upstream_key: Optional[str] = field(default=None, repr=False)  # None: from the environment (proxy/client.py)
    # Top-level fields added to each conversation step's upstream request, as
    # (name, JSON text): ("thinking", '{"type": "enabled"}').
    upstream_params: tuple[tuple[str, str], ...] = ()
    # The outbound stripper: passthrough sends every reasoning block (the escape
    # hatch); keep_tool_turn_reasoning keeps tool-call turns' reasoning (DeepSeek's documented rule).
    reasoning_passthrough: bool = False
    # Earlier turns' reasoning upstream: None drops it (the protocol's default);
    # "all_turns" keeps it (Responses' reasoning.context; Anthropic models that keep prior thinking).
    upstream_reasoning_context: Optional[str] = None
    keep_tool_turn_reasoning: bool = False

    def __post_init__(self) -> None:
        limit = model_context_limit(self.model)
        if self.max_context is None:
            object.__setattr__(self, "max_context", limit or DEFAULT_CONTEXT)
            object.__setattr__(self, "context_from_model", True)
        elif self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        elif limit is not None and self.max_context > limit:
            raise ValueError(f"max_context {self.max_context} is larger than the model's own limit of {limit} "
                             f"tokens (max_position_embeddings of {self.model!r}); leave it out to use {limit}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.pool_tokens < self.page_size:
            raise ValueError("pool_tokens must hold at least one page")
        if self.max_resident_conversations < 0:
            raise ValueError(f"max_resident_conversations must be >= 0, got {self.max_resident_conversations}")
        if self.max_conversations_per_tenant < 0:
            raise ValueError(f"max_conversations_per_tenant must be >= 0, got {self.max_conversations_per_tenant}")
        for name in ("max_tenant_bytes", "max_tools", "max_tools_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.request_deadline_s < 0:
            raise ValueError(f"request_deadline_s must be >= 0, got {self.request_deadline_s}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.kv_price is not None and not self.kv_price >= 0:
            raise ValueError(f"kv_price must be >= 0 FLOPs per KV token-second, got {self.kv_price}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if (self.backend == "upstream") != bool(self.upstream_url):
            raise ValueError("backend 'upstream' and upstream_url go together")
        if self.upstream_protocol not in UPSTREAM_PROTOCOLS:
            raise ValueError(f"upstream_protocol must be one of {', '.join(UPSTREAM_PROTOCOLS)}, "
                             f"got {self.upstream_protocol!r}")
        for name, text in self.upstream_params:
            try:
                json.loads(text)
            except ValueError:
                raise ValueError(f"upstream param {name}: {text!r} is not JSON") from None
        if self.upstream_reasoning_context not in (None, "auto", "all_turns", "current_turn"):
            raise ValueError("upstream_reasoning_context must be auto, all_turns or current_turn, "
                             f"got {self.upstream_reasoning_context!r}")
        if self.upstream_timeout_s <= 0:
            raise ValueError(f"upstream_timeout_s must be > 0, got {self.upstream_timeout_s}")
        if self.sglang_url is not None and self.backend != "sglang":
            raise ValueError("sglang_url needs backend 'sglang'")
        for name, url in (("upstream_url", self.upstream_url), ("router_url", self.router_url),
                          *(("sglang_url", u) for u in self.sglang_urls)):
            if url:
                try:
                    check_url(url)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if self.workers is not None and (self.workers < 0 or self.backend != "sglang"):
            raise ValueError("workers must be >= 0, with backend 'sglang'")
        if not 0 <= self.chain_lease_s <= 86400:
            raise ValueError(f"chain_lease_s must be within [0, 86400], got {self.chain_lease_s}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.workers == 0 and not self.sglang_urls:
            raise ValueError("workers 0 needs sglang_url: there would be no server")
        if self.router_url is not None and self.backend != "sglang":
            raise ValueError("router_url needs backend 'sglang'")
        if self.placement_epsilon <= 0:
            raise ValueError(f"placement_epsilon must be > 0, got {self.placement_epsilon}")
        if self.idle_ttl_s < 0:
            raise ValueError(f"idle_ttl_s must be >= 0, got {self.idle_ttl_s}")
        if self.session_idle_ttl_s < 0:
            raise ValueError(f"session_idle_ttl_s must be >= 0, got {self.session_idle_ttl_s}")
        for name in self.served_model_names:
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"served model names must be non-empty strings, got {name!r}")
        if self.max_tokens_limit is not None and not 1 <= self.max_tokens_limit <= self.max_context:
            raise ValueError(f"max_tokens_limit must be between 1 and max_context ({self.max_context}), "
                             f"got {self.max_tokens_limit}")
        if self.host_pool_tokens is not None and self.host_pool_tokens < 0:
            raise ValueError(f"host_pool_tokens must be >= 0, got {self.host_pool_tokens}")

    @property
    def sglang_key(self) -> Optional[str]:
        """The API key for SGLang's servers: sglang_api_key, else SGLANG_API_KEY."""
        import os

        return self.sglang_api_key or os.environ.get("SGLANG_API_KEY") or None

    @property
    def sglang_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in (self.sglang_url or "").split(",") if u.strip()]

    @property
    def launched_workers(self) -> int:
        return self.workers if self.workers is not None else (0 if self.sglang_urls else 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def host_tokens(self, bytes_per_token: int) -> int:
        """The host tier's capacity: host_pool_tokens, or by default 4x the device
        pool, at most a quarter of this machine's memory."""
        if self.host_pool_tokens is not None:
            return self.host_pool_tokens
        quarter = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        return min(4 * self.pool_tokens, quarter // bytes_per_token)

    def replace(self, **changes: object) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)
