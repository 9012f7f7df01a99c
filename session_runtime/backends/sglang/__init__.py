"""The SGLang backend: launch SGLang's server (or connect to one) with
`radix_ext`'s `session` radix-cache backend, and step conversations on it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import httpx

from radix_ext.sglang.control import ControlError
from session_runtime.backends.sglang.backend import SGLangBackend
from session_runtime.backends.sglang.control_client import RequestControl, client
from session_runtime.backends.sglang.launcher import LaunchFailed, LaunchSpec, launch
from session_runtime.errors import InvalidRequest

logger = logging.getLogger(__name__)

_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_folder(config, tokenizer) -> Path:
    """The Hugging Face folder SGLang loads: the model folder itself, or a preset's
    random weights saved once under the data directory (or the user's cache when
    conversations are kept in memory). Raises InvalidRequest."""
    from session_runtime.config import PRESETS

    if config.model in PRESETS:
        from session_runtime.model.export import export_preset

        return export_preset(config.model, config.seed, _models(config), min_vocab=tokenizer.vocab_size)
    folder = Path(config.model)
    if not (folder / "config.json").is_file():
        raise InvalidRequest(f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
                             "folder with config.json")
    return folder


def _models(config) -> Path:
    """Where the folders the runtime writes for SGLang go: under the data
    directory, or the user's cache when conversations are kept in memory."""
    return Path(config.data_dir) / "models" if config.data_dir else Path.home() / ".cache" / "session-runtime" / "models"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def tokenizer_folder(config, tokenizer, folder: Path) -> Path:
    """Where the launched server reads its tokenizer (its grammar backend,
    xgrammar, indexes the vocabulary; its stop-string matching decodes): the
    model folder when it has one, else the runtime's own tokenizer written
    once, into a preset's folder (ours) or beside the presets' folders, its
    end token the default template's (`config.template`, resolved by the
    Runtime: what xgrammar admits after a grammar ends when the model's config
    names no eos)."""
    from session_runtime.config import PRESETS
    from session_runtime.templates import build_template

    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return folder
    out = folder if config.model in PRESETS else _models(config) / "tokenizers" / tokenizer.digest
    if not (out / "tokenizer_config.json").is_file():
        stop = build_template(config.template, tokenizer, config.model).stop_token_ids
        eos = tokenizer.inner.id_to_token(min(stop)) if stop else None
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(tokenizer.inner.to_str())
        tmp = out / "tokenizer_config.json.tmp"  # written last, whole: its presence says the folder is complete
        tmp.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                                   "model_max_length": config.max_context}))
        tmp.replace(out / "tokenizer_config.json")
    return out


def _kv_shape(folder: Path, dtype: str) -> tuple[int, int]:
    """(bytes of KV per token, vocabulary size) from the folder's config.json:
    a K and a V per layer, or with DeepSeek's MLA one latent of kv_lora_rank +
    qk_rope_head_dim per layer (radix_ext/kv_layout.py)."""
    raw = json.loads((folder / "config.json").read_text())
    if raw.get("kv_lora_rank"):
        latent = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
        return raw["num_hidden_layers"] * latent * _ELEM[dtype], raw["vocab_size"]
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    kv_heads = raw.get("num_key_value_heads", heads)
    return 2 * raw["num_hidden_layers"] * kv_heads * head_dim * _ELEM[dtype], raw["vocab_size"]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _server_info(url: str, http: httpx.Client) -> dict:
    try:
        resp = http.get(f"{url}/server_info", timeout=30.0)
        if resp.status_code in (401, 403):
            raise InvalidRequest(f"the SGLang server at {url} refused the runtime's API key (HTTP "
                                 f"{resp.status_code}): give its --api-key as --sglang-api-key or SGLANG_API_KEY")
        resp.raise_for_status()
        return resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {url}/server_info: {exc}") from None


def build(config, tokenizer):
    """Launch (or connect to) the server(s) and check each runs our backend: one
    SGLangBackend, or a WorkerPool when there are several (given URLs first, then
    launched servers; ids w0, w1, ...), with sglang-router for stateless steps
    (`router_url`, or one launched over the workers). Raises InvalidRequest
    naming the cause when one cannot start or is not ours."""
    urls, launched = config.sglang_urls, config.launched_workers
    if len(urls) + launched == 1:
        return _worker(config, tokenizer, urls[0] if urls else None, 0)
    from session_runtime.backends.sglang.workers import WorkerPool

    workers: dict[str, SGLangBackend] = {}
    try:
        share = max(1, (os.cpu_count() or 1) // launched) if launched > 1 else None  # cores per launched server
        for i, url in enumerate([*urls, *[None] * launched]):
            workers[f"w{i}"] = _worker(config, tokenizer, url, i, share)
        router = _router(config, workers)
        return WorkerPool(workers, epsilon=config.placement_epsilon, router=router)
    except BaseException:
        for w in workers.values():
            w.close()
        raise


def _router(config, workers: dict[str, SGLangBackend]):
    """sglang-router for the pool's stateless steps: the one at `router_url`, or
    one launched over the workers (its log router.log beside the store)."""
    from session_runtime.backends.sglang.router import RoutedBackend, RouterSpec, launch_router, serves

    urls = [w.url for w in workers.values()]
    like = next(iter(workers.values()))
    if config.router_url:
        url = config.router_url.rstrip("/")
        if not _ready(url):
            raise InvalidRequest(f"no sglang-router answers at {url}/health")
        if not serves(url, urls):
            logger.warning("the sglang-router at %s does not list every worker (%s) as healthy; stateless "
                           "steps go wherever it routes them", url, ", ".join(urls))
        return RoutedBackend(url, like)
    log = str(Path(config.data_dir) / "router.log") if config.data_dir else None
    server = launch_router(RouterSpec(worker_urls=tuple(urls), log_path=log))
    logger.info("sglang-router at %s over %d workers, up in %.1f s", server.url, len(urls), server.started_s)
    return RoutedBackend(server.url, like, router=server)


def _worker(config, tokenizer, url, index: int, threads: Optional[int] = None) -> SGLangBackend:
    """Connect to `url`, or launch a server (its log sglang-INDEX.log beside the store)."""
    server = None
    if url is not None:
        if not _ready(url):
            raise InvalidRequest(f"no SGLang server answers at {url}/health")
    else:
        folder = model_folder(config, tokenizer)
        log = f"sglang-{index}.log" if index else "sglang.log"
        spec = LaunchSpec(
            model_path=str(folder), page_size=config.page_size, max_total_tokens=config.pool_tokens,
            dtype=config.dtype, device=config.device, context_length=config.max_context,
            max_running_requests=config.sglang_max_running, seed=config.seed, extra_args=tuple(config.sglang_args),
            log_path=str(Path(config.data_dir) / log) if config.data_dir else None, threads=threads,
            tp_size=config.tp_size, api_key=config.sglang_key,
            tokenizer_path=str(tokenizer_folder(config, tokenizer, folder)),
        )
        try:
            server = launch(spec, _ready)
        except LaunchFailed as exc:
            raise InvalidRequest(str(exc)) from None
        url = server.url
    try:
        return _connect(config, tokenizer, url, server)
    except BaseException:
        if server is not None:
            server.stop()
        raise


def _connect(config, tokenizer, url: str, server) -> SGLangBackend:
    http = client(config.sglang_key)
    try:
        return _check_server(config, tokenizer, url, server, http)
    except BaseException:
        http.close()
        raise


def _check_server(config, tokenizer, url: str, server, http: httpx.Client) -> SGLangBackend:
    info = _server_info(url, http)
    if info.get("radix_cache_backend") != "session":
        raise InvalidRequest(
            f"the SGLang server at {url} runs radix-cache backend {info.get('radix_cache_backend')!r}; the runtime "
            "needs 'session': start it with --radix-cache-backend session, with session-runtime installed in "
            "its Python environment")
    if info.get("skip_tokenizer_init"):
        logger.warning("the SGLang server at %s runs with --skip-tokenizer-init: it has no grammar backend, so "
                       "requests that force a tool, ask for a JSON schema or set stop sequences are refused", url)
    control = RequestControl(url, http)
    try:
        ping = control.call("ping", timeout_s=60.0)
    except ControlError as exc:
        raise InvalidRequest(f"the session backend at {url} does not answer a command: {exc.message}") from None
    tp_size = int(ping.get("tp_size") or info.get("tp_size") or 1)
    if server is None and config.tp_size > 1 and tp_size != config.tp_size:
        raise InvalidRequest(f"--tp-size {config.tp_size} was given, but the SGLang server at {url} runs "
                             f"{tp_size} tensor-parallel ranks")
    folder = Path(info.get("model_path") or config.model)
    dtype = info.get("dtype") if info.get("dtype") in _ELEM else config.dtype
    bytes_per_token, vocab = _kv_shape(folder, dtype) if (folder / "config.json").is_file() else (0, 1 << 31)
    if tokenizer.vocab_size > vocab:
        raise InvalidRequest(f"tokenizer has {tokenizer.vocab_size} ids, the model only {vocab}")
    derived = int(info.get("context_length") or config.max_context)
    if config.max_context > derived and not config.context_from_model:
        raise InvalidRequest(f"--max-context {config.max_context} is larger than the context of the SGLang server "
                             f"at {url} ({derived} tokens); leave it out to use {derived}")
    return SGLangBackend(url, control, page_size=ping["page_size"], capacity=ping["capacity"],
                         constrains=not info.get("skip_tokenizer_init"),
                         bytes_per_token=bytes_per_token, vocab_size=vocab, max_context=min(config.max_context, derived),
                         server=server, host_tokens=config.host_tokens(bytes_per_token), tp_size=tp_size,
                         lease_s=config.chain_lease_s)
