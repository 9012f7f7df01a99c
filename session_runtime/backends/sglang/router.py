"""Stateless steps through `sglang-router` (its cache-aware policy), which the
runtime launches over its workers or is given by `--router-url`.

A request without a conversation of its own (`/v1/chat/completions` without
`conversation_id`) has no chain to keep on one worker, so the router may put
it wherever the prefix it carries is cached. Its cache-aware policy sees
`input_ids`: sglang-router 0.3.2 keys its per-worker prefix tree on
`GenerateRequest::extract_text_for_routing`, which for `input_ids` is the ids
written in decimal and joined by spaces (`src/protocols/generate.rs`, lines
214-236); a shared id prefix is a shared character prefix. So stateless steps
go through it with the same `input_ids` as any step, and no text is decoded.

What the router does not carry: it re-serializes the request from its own
`GenerateRequest` struct (`src/routers/http/router.rs`, `send_typed_request`),
which has no `session_id`, `kv_hints` or `cache_salt`. A routed step therefore
holds no chain (the worker caches prompt and output in its tree, evictable),
and the tenant's salt is folded into `extra_key` (which it carries) so tenants
stay apart in the workers' trees. Its accounting is what the worker reports
(`meta_info.cached_tokens`); the runtime cannot probe a tree it does not
choose, so a routed step's logical reuse is what was cached.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import httpx

from radix_ext.tree import Namespace, NodeInfo
from session_runtime.backends.base import HoldsNoChain, StepRequest, StepResult
from session_runtime.backends.sglang.backend import SGLangBackend
from session_runtime.backends.sglang.control_client import client
from session_runtime.backends.sglang.launcher import LaunchedServer, LaunchFailed, free_port, launch
from session_runtime.errors import InvalidRequest

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RouterSpec:
    """`python -m sglang_router.launch_router` over `worker_urls`."""

    name = "sglang-router"  # in the launcher's messages
    worker_urls: tuple[str, ...]
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: a free one
    log_path: Optional[str] = None
    health_interval_s: int = 10  # the router's own checks (its default is 60 s)
    # Its Prometheus exporter's port. None: a free one; its default, 29000 on every
    # interface, lets only one router run on a machine (a second runtime process's
    # router exited with "Address already in use").
    metrics_port: Optional[int] = None

    def argv(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", self.host, "--port", str(port),
            "--worker-urls", *self.worker_urls,
            "--policy", self.policy,
            "--health-check-interval-secs", str(self.health_interval_s),
            "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port or free_port(self.host)),
            "--log-level", "warn",
        ]


SALT = "|salt="  # never in the runtime's own extra_key (model|tokenizer|template)


def routed_namespace(namespace: Namespace) -> Namespace:
    """The namespace a step has on the worker after the router: its salt folded
    into `extra_key`, the one of the two that the router passes on."""
    if namespace.cache_salt is None:
        return namespace
    return Namespace(extra_key=f"{namespace.extra_key or ''}{SALT}{namespace.cache_salt}", cache_salt=None)


def unfold(node: NodeInfo) -> NodeInfo:
    """A tree node as its tenant owns it: a routed step's folded salt back in
    `cache_salt`, so that a tenant's view of the tree (api/auth.py) shows it to
    that tenant alone."""
    if node.cache_salt is not None or not node.namespace or SALT not in node.namespace:
        return node
    extra_key, _, salt = node.namespace.partition(SALT)
    return dataclasses.replace(node, namespace=extra_key, cache_salt=salt)


def serves(url: str, worker_urls: Sequence[str]) -> bool:
    """Does the router at `url` list every one of `worker_urls` as healthy? Its
    `/health` answers before it has registered them."""
    try:
        resp = httpx.get(f"{url}/workers", timeout=5.0)
        listed = {w["url"].rstrip("/") for w in resp.json().get("workers", []) if w.get("is_healthy", True)}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return set(worker_urls) <= listed


def launch_router(spec: RouterSpec, timeout_s: float = START_TIMEOUT_S) -> LaunchedServer:
    """Start the router (its own process group) and wait until it lists every
    worker. Raises InvalidRequest with its log's tail when it does not."""
    try:
        return launch(spec, lambda url: serves(url, spec.worker_urls), timeout_s, env=dict(os.environ))
    except LaunchFailed as exc:
        raise InvalidRequest(str(exc)) from None


class RoutedBackend(HoldsNoChain, SGLangBackend):
    """Steps sent to the router's `/generate`; it holds no chain and takes no
    command, so every chain call is a no-op here (probes too: the router picks
    the tree after them)."""

    probes_in_step = False  # the router drops kv_hints: the (empty) probes are HoldsNoChain's

    def __init__(self, url: str, like: SGLangBackend, router: Optional[LaunchedServer] = None):
        super().__init__(url, control=None, page_size=like.page_size, capacity=like.capacity,
                         bytes_per_token=like.bytes_per_token, vocab_size=like.vocab_size,
                         max_context=like.max_context, constrains=like.constrains,
                         http=client(headers=getattr(getattr(like, "http", None), "headers", None)))
        self.router = router  # a LaunchedServer this process started, or None for --router-url
        self.steps = 0

    def step(self, req: StepRequest) -> StepResult:
        # What the router's worker does with it: caches prompt and output, holds nothing.
        result = super().step(dataclasses.replace(req, namespace=routed_namespace(req.namespace),
                                                  hold_chain=False, cache_output=True))
        self.steps += 1
        return result

    def _body(self, req: StepRequest, prompt: list[int], forced: Optional[list[int]], promote: bool,
              riding=()) -> dict:
        body = super()._body(req, prompt, forced, False)  # nothing rides: the router holds no chain
        for field in ("session_id", "kv_hints", "cache_salt"):  # the router drops them: say so by not sending
            body.pop(field, None)
        return body

    def available(self) -> bool:
        return self.router is None or self.router.alive()

    def expect_host(self, owner: str) -> None:
        pass

    def mark_waiting(self, owner: str) -> None:
        pass

    def demote(self, owner: str, copy: bool = True) -> int:
        return 0

    def drop_host_copy(self, owner: str) -> None:
        pass

    def host_bytes(self, owner: str) -> int:
        return 0

    def describe(self) -> str:
        where = "launched by the runtime" if self.router is not None else "given by --router-url"
        return f"sglang-router at {self.url} ({where}; stateless steps)"

    def close(self) -> None:
        self.http.close()
        self.step_http.close()
        if self.router is not None:
            self.router.stop()
