"""`session-runtime serve`: the HTTP server over a backend (the embedded
engine by default, SGLang's server with `--backend sglang`, or a provider's
API with `--upstream URL`);
`session-runtime replay`: a recorded trace through the embedded runtime."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import time
import warnings
from urllib.parse import urlsplit

from session_runtime.api.settings import ApiSettings, allowed_hosts, is_loopback, load_credentials
from session_runtime.config import ATTENTION_BACKENDS, PRESETS, UPSTREAM_PROTOCOLS, RuntimeConfig
from session_runtime.protocols.base import PASSTHROUGH_ENV, passthrough_from_env

_DEFAULTS = RuntimeConfig()
_API_DEFAULTS = ApiSettings()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="session-runtime")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the session HTTP API", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--backend", default=_DEFAULTS.backend, choices=["embedded", "sglang", "upstream"],
                       help="embedded: our engine in this process, one step at a time; sglang: SGLang's own "
                            "server (batched), launched from these model flags or given by --sglang-url")
    serve.add_argument("--upstream", default=None, metavar="URL",
                       help="upstream proxy mode: a provider's API answers each step instead of a local "
                            "engine; URL is its SDK's base_url (https://api.deepseek.com/v1; Anthropic's and Google's "
                            "without /v1)")
    serve.add_argument("--upstream-protocol", default=_DEFAULTS.upstream_protocol, choices=UPSTREAM_PROTOCOLS,
                       help="the protocol --upstream speaks")
    serve.add_argument("--upstream-key", default=None, metavar="KEY",
                       help="the provider's API key (default: $SESSION_RUNTIME_UPSTREAM_KEY, else the protocol's "
                            "usual variable: DEEPSEEK_API_KEY, OPENAI_API_KEY or ANTHROPIC_API_KEY)")
    serve.add_argument("--upstream-model", default=None, metavar="NAME",
                       help="the model name sent upstream (default: the request's, else --model-id/--model)")
    serve.add_argument("--upstream-param", action="append", default=[], metavar="NAME=JSON",
                       help="a top-level field for each conversation step's upstream request (repeatable), "
                            "e.g. --upstream-param 'thinking={\"type\": \"enabled\"}'; null leaves a field out "
                            "(temperature=null for reasoning models that refuse one)")
    serve.add_argument("--upstream-timeout-s", type=float, default=_DEFAULTS.upstream_timeout_s, metavar="S",
                       help="how long one upstream request may take")
    serve.add_argument("--reasoning-passthrough", action="store_true",
                       help="the escape hatch: send every reasoning block upstream unstripped (also "
                            f"{PASSTHROUGH_ENV}=1)")
    serve.add_argument("--upstream-reasoning-context", default=None, choices=["auto", "all_turns", "current_turn"],
                       help="earlier turns' reasoning upstream: all_turns keeps it (OpenAI Responses' "
                            "reasoning.context; Anthropic models that keep prior thinking, whose prefix must "
                            "not change); default: dropped between turns")
    serve.add_argument("--keep-tool-turn-reasoning", action="store_true",
                       help="DeepSeek: keep completed tool-call turns' reasoning on the way out (the documented "
                            "rule), for a provider that enforces it; by default it is stripped in lenient shapes")
    serve.add_argument("--validate", default=None, choices=UPSTREAM_PROTOCOLS, metavar="PROTOCOL",
                       help="check incoming requests as this provider's API does (deepseek, openai-chat, "
                            "openai-responses, anthropic, gemini) before answering with the local engine: a "
                            "validating upstream for tests and offline checks")
    serve.add_argument("--sglang-url", default=None,
                       help="with --backend sglang: running SGLang servers started with "
                            "--radix-cache-backend session, URL1,URL2,... (each a worker; default: launch one)")
    serve.add_argument("--workers", type=int, default=None,
                       help="with --backend sglang: how many SGLang servers (workers) the runtime launches, "
                            "besides those of --sglang-url (default 1 without --sglang-url, else 0); each "
                            "conversation lives on one worker. Not uvicorn workers")
    serve.add_argument("--placement-epsilon", type=float, default=_DEFAULTS.placement_epsilon,
                       help="many workers: no worker holds more than (1 + epsilon) x the mean number of "
                            "conversations (consistent hashing with bounded loads)")
    serve.add_argument("--router-url", default=None,
                       help="many workers: a running sglang-router over them, for requests without a "
                            "conversation (default: the runtime launches one with --policy cache_aware)")
    serve.add_argument("--sglang-arg", action="append", default=[], metavar="FLAG",
                       help="an extra flag for the SGLang server the runtime launches (repeatable), "
                            "e.g. --sglang-arg=--chunked-prefill-size=2048")
    serve.add_argument("--sglang-api-key", default=None, metavar="KEY",
                       help="with --backend sglang: SGLang's --api-key, sent with every request and command "
                            "(default: SGLANG_API_KEY from the environment); passed to a launched server")
    serve.add_argument("--tp-size", type=int, default=_DEFAULTS.tp_size, metavar="N",
                       help="with --backend sglang: tensor-parallel ranks of a launched server (on cpu each "
                            "rank gets its share of the cores: SGLANG_CPU_OMP_THREADS_BIND unless set); a "
                            "server given by --sglang-url says its own")
    serve.add_argument("--chain-lease-s", type=float, default=_DEFAULTS.chain_lease_s, metavar="S",
                       help="with --backend sglang: SGLang holds each conversation's KV chain under this "
                            "runtime's lease, renewed by its steps and a heartbeat; a runtime gone longer than "
                            "this leaves its chains to SGLang's LRU (0: no lease; a dead runtime's chains stay)")
    serve.add_argument("--sglang-max-running", type=int, default=_DEFAULTS.sglang_max_running,
                       help="--max-running-requests of the launched SGLang server")
    serve.add_argument("--model", default=_DEFAULTS.model,
                       help=f"a preset ({', '.join(PRESETS)}) or a local Hugging Face folder")
    serve.add_argument("--device", default=_DEFAULTS.device, help="cpu or cuda")
    serve.add_argument("--dtype", default=_DEFAULTS.dtype, help="float32, bfloat16 or float16")
    serve.add_argument("--attention", default=_DEFAULTS.attention, choices=ATTENTION_BACKENDS,
                       help="auto: flashinfer on cuda where it runs, else torch SDPA")
    serve.add_argument("--page-size", type=int, default=_DEFAULTS.page_size, help="tokens per KV page")
    serve.add_argument("--pool-tokens", type=int, default=_DEFAULTS.pool_tokens, help="device KV pool size")
    serve.add_argument("--host-pool-tokens", type=int, default=_DEFAULTS.host_pool_tokens,
                       help="host-tier KV capacity in tokens for tool-wait offload, allocated at start "
                            "(pinned on cuda); default 4x --pool-tokens, at most a quarter of host memory")
    serve.add_argument("--offload", default=_DEFAULTS.offload, choices=["never", "always", "ttl", "pressure"],
                       help="default tool-wait offload policy of new conversations")
    serve.add_argument("--idle-ttl-s", type=float, default=_DEFAULTS.idle_ttl_s,
                       help="a closed conversation idle this long leaves the device (to the host tier, or "
                            "released when it is full); under pressure idle ones go first; 0: never")
    serve.add_argument("--max-context", type=int, default=None,
                       help="the longest sequence (prompt plus output) a step may reach; default: the model's "
                            "own limit (max_position_embeddings, or what a given SGLang server derives)")
    serve.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                       help="the most tokens one step may generate: the ceiling of every request's budget, "
                            "and the budget of a request that sets none (default and maximum: --max-context)")
    serve.add_argument("--served-model-name", action="append", default=[], metavar="NAME[,NAME...]",
                       help="the model names clients may ask for (repeatable, or comma-separated; the first is "
                            "the one answers name; a request's '[1m]' suffix is ignored); default: --model")
    serve.add_argument("--session-idle-ttl-s", type=float, default=_DEFAULTS.session_idle_ttl_s, metavar="S",
                       help="an inferred conversation (a stateless client's, matched by its history) with no "
                            "request for this long is deleted (0: never); explicit conversations never expire")
    serve.add_argument("--max-body-bytes", type=int, default=_API_DEFAULTS.max_body_bytes, metavar="N",
                       help="larger request bodies are refused with 413 before they are read")
    serve.add_argument("--request-deadline-s", type=float, default=_DEFAULTS.request_deadline_s, metavar="S",
                       help="a step still running after S seconds stops, fails with 408 and changes nothing (0: none)")
    serve.add_argument("--max-conversations-per-tenant", type=int, default=_DEFAULTS.max_conversations_per_tenant,
                       metavar="N", help="a tenant's conversations the server keeps; one more is 429 (0: no limit)")
    serve.add_argument("--max-resident-conversations", type=int, default=_DEFAULTS.max_resident_conversations,
                       metavar="N", help="with --data-dir: conversations kept in memory; past it the least recently "
                                         "used idle ones leave memory and are read back at their next use (0: no bound)")
    serve.add_argument("--max-tenant-bytes", type=int, default=_DEFAULTS.max_tenant_bytes, metavar="N",
                       help="bytes of conversations (as stored) a tenant may hold; past it new steps and "
                            "conversations are 429 (0: no limit)")
    serve.add_argument("--max-tools", type=int, default=_DEFAULTS.max_tools, metavar="N",
                       help="tools one conversation may have (0: no limit)")
    serve.add_argument("--max-tools-bytes", type=int, default=_DEFAULTS.max_tools_bytes, metavar="N",
                       help="bytes of one conversation's tools, as JSON (0: no limit)")
    serve.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of random preset weights")
    serve.add_argument("--policy", default=_DEFAULTS.policy,
                       choices=["keep", "drop", "keep_last_k", "auto", "engine_default", "strip_thinking_cache"],
                       help="default reasoning policy of new conversations (auto: each turn keeps or drops its "
                            "reasoning by what each costs, priced as the replay's verdict prices it)")
    serve.add_argument("--cost-model", default=None, metavar="NAME",
                       help="policy auto: the model shape its choices are priced for, a preset or a local folder "
                            "with config.json (default: --model)")
    serve.add_argument("--kv-price", type=float, default=None, metavar="FLOPS",
                       help="policy auto: what holding one KV token for one second costs, in FLOPs (default: "
                            "the replay's, one H100-second of compute against its 80 GB of HBM for a second)")
    serve.add_argument("--template", default=_DEFAULTS.template, choices=["auto", "deepseek", "qwen3", "hf"],
                       help="hf: the model folder's own chat template; auto: a built-in template for a folder whose "
                            "chat template is its official one, hf for any other, else qwen3 for Qwen's tokenizer, "
                            "else deepseek")
    serve.add_argument("--data-dir", default="data", help="SQLite store of conversations ('' keeps them in memory)")
    serve.add_argument("--store", default=None, metavar="URL",
                       help="keep conversations in PostgreSQL (postgresql://user@host:port/database; a password "
                            "from libpq's PGPASSWORD or ~/.pgpass) instead of --data-dir's SQLite file; several "
                            "processes over one store share its conversations, each serving its own (docs/fleet.md)")
    serve.add_argument("--advertise-url", default=None, metavar="URL",
                       help="with --store: the URL the other processes over the store reach this one at (default: "
                            "http://HOST:PORT, the machine's name for a wildcard --host)")
    serve.add_argument("--member-ttl-s", type=float, default=_DEFAULTS.member_ttl_s, metavar="S",
                       help="with --store: a process silent this long is gone, and the others take its "
                            "conversations over")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind; one other than loopback needs an API key (or --insecure)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port, 1 to 65535; bound before the model loads")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="clients send 'Authorization: Bearer KEY'; alone, KEY is the admin key and the "
                            "key of one default tenant (with --admin-key, only the default tenant's)")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help='a JSON object {"KEY": "TENANT", ...}: each key is one tenant\'s, which sees '
                            "only its own conversations and tree nodes")
    serve.add_argument("--admin-key", default=None, metavar="KEY",
                       help="the key that sees every tenant and may act for one (the body's 'tenant'), "
                            "and may call /admin/*")
    serve.add_argument("--metrics-admin-only", action="store_true",
                       help="/metrics needs the admin key (default: open, like /health)")
    serve.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                       help="Host header values answered besides --host and localhost, 127.0.0.1, [::1] "
                            "(comma-separated names, without ports; '*': any); others get 400, against DNS "
                            "rebinding")
    serve.add_argument("--no-access-log", action="store_true",
                       help="no line per request on stderr (method, path, status, tenant, latency; never user text)")
    serve.add_argument("--insecure", action="store_true",
                       help="serve a non-loopback --host without any API key (anyone who reaches it may "
                            "read and change every conversation)")
    from session_runtime.replay import add_arguments as replay_arguments

    replay_arguments(sub.add_parser("replay", help="replay recorded agent traces with forced output, "
                                                   "print keep-vs-drop accounting"))
    return parser


def _check_model(model: str) -> None:
    """A preset or a local folder with config.json, checked before anything heavy
    is imported (a typo fails in milliseconds, not after SGLang's import)."""
    from pathlib import Path

    from session_runtime.config import PRESETS

    if model not in PRESETS and not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local folder "
                         f"with config.json (cwd {Path.cwd()})")


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    _check_model(args.model)
    if args.upstream and args.backend == "sglang":
        raise ValueError("--upstream answers steps with a provider's API: it does not go with --backend sglang")
    if args.upstream and args.validate:
        raise ValueError("--validate answers with the local engine: it does not go with --upstream")
    upstream = bool(args.upstream) or args.backend == "upstream"
    if upstream and not args.upstream:
        raise ValueError("--backend upstream needs --upstream URL")
    if args.store is not None and urlsplit(args.store).scheme not in ("postgresql", "postgres"):
        raise ValueError(f"--store takes a PostgreSQL URL (postgresql://user@host:port/database), got {args.store!r}")
    return RuntimeConfig(
        upstream_url=args.upstream, upstream_protocol=args.upstream_protocol, upstream_key=args.upstream_key,
        upstream_model=args.upstream_model, upstream_timeout_s=args.upstream_timeout_s,
        upstream_params=tuple(_param(p) for p in args.upstream_param),
        reasoning_passthrough=args.reasoning_passthrough or passthrough_from_env(),
        keep_tool_turn_reasoning=args.keep_tool_turn_reasoning,
        upstream_reasoning_context=args.upstream_reasoning_context,
        model=args.model, device=args.device, dtype=args.dtype, attention=args.attention, page_size=args.page_size,
        pool_tokens=args.pool_tokens, max_context=args.max_context, max_tokens_limit=args.max_tokens_limit,
        seed=args.seed,
        policy=args.policy, cost_model=args.cost_model, kv_price=args.kv_price,
        template=args.template, data_dir=args.data_dir or None, store=args.store,
        advertise_url=_advertised(args) if args.store else None, member_ttl_s=args.member_ttl_s,
        host_pool_tokens=args.host_pool_tokens, offload=args.offload, idle_ttl_s=args.idle_ttl_s,
        backend="upstream" if upstream else args.backend, sglang_url=args.sglang_url, sglang_args=tuple(_split_args(args.sglang_arg)),
        workers=args.workers, placement_epsilon=args.placement_epsilon, router_url=args.router_url,
        sglang_max_running=args.sglang_max_running, sglang_api_key=args.sglang_api_key, tp_size=args.tp_size,
        chain_lease_s=args.chain_lease_s, request_deadline_s=args.request_deadline_s,
        max_conversations_per_tenant=args.max_conversations_per_tenant,
        max_resident_conversations=args.max_resident_conversations,
        max_tenant_bytes=args.max_tenant_bytes, max_tools=args.max_tools, max_tools_bytes=args.max_tools_bytes,
        served_model_names=served_names(args.served_model_name),
        session_idle_ttl_s=args.session_idle_ttl_s,
    )


def served_names(values: list[str]) -> tuple[str, ...]:
    """--served-model-name values, each a comma-separated list, in order, once each."""
    names = [n.strip() for v in values for n in v.split(",")]
    if any(not n for n in names):
        raise ValueError(f"--served-model-name takes non-empty names, got {values!r}")
    return tuple(dict.fromkeys(names))


def _advertised(args: argparse.Namespace) -> str:
    if args.advertise_url:
        if urlsplit(args.advertise_url).scheme not in ("http", "https"):
            raise ValueError(f"--advertise-url must be an http(s) URL, got {args.advertise_url!r}")
        return args.advertise_url
    host = socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host
    return f"http://{'[' + host + ']' if ':' in host else host}:{args.port}"


def _param(text: str) -> tuple[str, str]:
    """`NAME=JSON` of --upstream-param. Raises ValueError."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--upstream-param {text!r}: expected NAME=JSON")
    try:
        json.loads(value)
    except ValueError:
        raise ValueError(f"--upstream-param {text!r}: {value!r} is not JSON (a string is quoted: "
                         f"{name.strip()}='\"{value}\"')") from None
    return name.strip(), value


def _split_args(flags: list[str]) -> list[str]:
    """`--sglang-arg=--x=1` and `--sglang-arg='--x 1'` both give SGLang `--x 1`."""
    out: list[str] = []
    for flag in flags:
        for part in flag.split():
            out.extend(part.split("=", 1) if part.startswith("--") and "=" in part else [part])
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("session-runtime")
    except PackageNotFoundError:
        return "unknown"


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a port in use fails before the model
    loads, and "listening" is printed only once the address is ours. Raises
    ValueError."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be between 1 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return sock


def api_settings_from_args(args: argparse.Namespace) -> ApiSettings:
    """The HTTP edge's settings. Raises ValueError (a bad keys file, a public
    --host without a key)."""
    credentials = load_credentials(args.api_key, args.api_keys, args.admin_key)
    if not credentials.enabled and not is_loopback(args.host) and not args.insecure:
        raise ValueError(f"--host {args.host} serves other machines, and no API key is set: anyone who reaches "
                         "it could read and change every conversation. Give --api-key KEY (or --api-keys "
                         "FILE), or --insecure to serve it open anyway")
    return ApiSettings(credentials=credentials, metrics_admin_only=args.metrics_admin_only, validate=args.validate,
                       max_body_bytes=args.max_body_bytes, allowed_hosts=allowed_hosts(args.host, args.allowed_hosts))


def serve(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:  # every flag is checked, and the port bound, before torch or SGLang is imported
        config = config_from_args(args)
        settings = api_settings_from_args(args)
        sock = _bind(args.host, args.port)
    except ValueError as exc:
        print(f"session-runtime: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    warnings.filterwarnings("ignore", module="sglang")
    wait = "starting SGLang's server takes about a minute on a CPU" if config.backend == "sglang" else \
        "importing SGLang takes 6-20 s"
    if config.backend == "upstream":  # no model here: the template's tokenizer counts what is stripped
        print(f"session-runtime: {config.upstream_protocol} upstream at {config.upstream_url}, counting tokens with "
              f"{config.model}'s tokenizer ({wait}), then serving http://{args.host}:{args.port}", flush=True)
    else:
        print(f"session-runtime: loading {config.model} on {config.device} with the {config.backend} backend "
              f"({wait}), then serving http://{args.host}:{args.port}", flush=True)
    from session_runtime.api.app import create_app
    from session_runtime.errors import InvalidRequest
    from session_runtime.runtime import Runtime

    try:
        runtime = Runtime(config)
    except InvalidRequest as exc:
        sock.close()
        print(f"session-runtime: {exc}", file=sys.stderr)
        return 2
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again
    # with the handler it found: make that an exception, so the `finally`
    # below closes the runtime and stops a launched SGLang server's process group.
    signal.signal(signal.SIGTERM, lambda sig, _frame: sys.exit(128 + sig))
    if not args.no_access_log:
        logging.getLogger("session_runtime.access").setLevel(logging.INFO)
    try:
        app = create_app(runtime, settings)
        sock.listen(2048)  # from now on a connection waits for uvicorn instead of being refused
        print(f"session-runtime: ready in {time.perf_counter() - t0:.1f}s, listening on "
              f"http://{args.host}:{args.port} ({runtime.backend.describe()})", flush=True)
        server = _Server(runtime, uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                                 timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        runtime.close()
    return 0


def _Server(runtime, config):
    """uvicorn's server, which on SIGTERM or Ctrl-C first stops the steps in
    flight (they fail with 503 and change nothing) so the graceful shutdown that
    follows takes seconds, not a long generation's time."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            runtime.stop_steps()
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "replay":
        from session_runtime.replay import run_command

        return run_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
