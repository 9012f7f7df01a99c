"""Authentication at the edge: the API key names the caller, and the caller's
tenant decides what it sees.

`Authenticate` runs before a route reads its body: it finds the key (as vLLM
and SGLang take it, `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's
SDK sends it, or on the Gemini routes `x-goog-api-key: KEY` or `?key=KEY` as
Google's clients send it; a browser's Basic credentials
with the key as password also work, so the tree page can be opened), answers
401 or 403 itself, and leaves the Caller in `request.state.caller`. Routes ask
for it with `Depends(current_caller)`. Without any key configured every caller
is the open admin, as before keys existed.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Iterable, Optional
from urllib.parse import parse_qsl

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radix_ext.tree import NodeInfo
from session_runtime.api.errors import ApiError, Forbidden, error_response, is_gemini_route
from session_runtime.api.settings import OPEN, ApiSettings, Caller, host_name
from session_runtime.conversation import Conversation
from session_runtime.errors import ConversationNotFound

if TYPE_CHECKING:
    from session_runtime.runtime import Runtime

# Open to everyone: liveness, the version, and the API's schema (no data).
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json"})


def presented_key(authorization: Optional[str]) -> Optional[str]:
    """The key in an Authorization header: `Bearer KEY`, or Basic with KEY as
    the password (any user name). None when there is none."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            user_pass = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return user_pass.partition(":")[2] or None
    return None


class Authenticate:
    """Pure ASGI middleware (it must answer before the body is read)."""

    def __init__(self, app: ASGIApp, settings: ApiSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        api_key = _header(scope, b"x-api-key")
        if api_key is None and is_gemini_route(path):
            api_key = _header(scope, b"x-goog-api-key") or _query_key(scope)
        caller, refusal = self._decide(path, _header(scope, b"authorization"), api_key)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if caller is not None:
            scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

    def _decide(self, path: str, authorization: Optional[str], api_key: Optional[str] = None):
        """(the caller, or None; a refusal to send, or None). `api_key`: the
        `x-api-key` header, where Anthropic's SDK sends the key."""
        credentials = self.settings.credentials
        if not credentials.enabled:
            return OPEN, None
        key = presented_key(authorization) or (api_key.strip() or None if api_key else None)
        caller = credentials.identify(key) if key is not None else None
        is_open = path in OPEN_PATHS or (path == "/metrics" and not self.settings.metrics_admin_only)
        if is_open:  # no route there asks who calls: None (the access log's "-") without a valid key
            return caller, None
        if caller is None:
            # A browser asked for a Basic challenge opens the tree page with the key as password.
            challenge = 'Basic realm="session-runtime"' if path.startswith("/debug/") else "Bearer"
            message = ("no API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')" if key is None
                       else "the API key is not valid")
            return None, error_response(ApiError(401, "unauthorized", message,
                                                 headers={"www-authenticate": challenge}), path)
        if not caller.admin and (path.startswith("/admin/") or path == "/metrics"):
            return None, error_response(ApiError(403, "forbidden", f"{path} needs the admin key"), path)
        return caller, None


class CheckHost:
    """Pure ASGI middleware: a request whose Host header the server does not
    answer to (ApiSettings.allowed_hosts) gets 400, before anything else."""

    def __init__(self, app: ASGIApp, allowed: Optional[frozenset[str]]):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            header = _header(scope, b"host")
            if header is None or host_name(header) not in self.allowed:
                message = (f"the Host header {header!r} is not one this server answers to "
                           f"({', '.join(sorted(self.allowed))}; see --allowed-hosts)")
                await error_response(ApiError(400, "invalid_host", message), scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AccessLog:
    """Pure ASGI middleware, outermost: one line per request on the
    `session_runtime.access` logger (INFO): method, path, status, tenant and
    latency. Never the query or the body: no user text reaches the log."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.log = logging.getLogger("session_runtime.access")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            caller = scope.get("state", {}).get("caller")
            who = "-" if caller is None else ("admin" if caller.admin else (caller.tenant or "default"))
            self.log.info("%s %s %d tenant=%s %.1fms", scope["method"], scope["path"], status or 500, who,
                          (time.perf_counter() - t0) * 1e3)


def _header(scope: Scope, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _query_key(scope: Scope) -> Optional[str]:
    """The `key` query parameter (Google's clients may send the key so)."""
    for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
        if name == "key":
            return value
    return None


async def current_caller(request: Request) -> Caller:
    """The route's Caller, as Authenticate found it (a FastAPI dependency; async: FastAPI would run a
    plain one on its thread pool, a thread hop per request)."""
    return request.state.caller


def visible(runtime: Runtime, cid: str, caller: Caller) -> Conversation:
    """The conversation, if the caller may see it. Raises ConversationNotFound
    for another tenant's too: its existence is not the caller's business."""
    conv = runtime.get(cid)
    if not caller.may_see(conv.tenant):
        raise ConversationNotFound(cid)
    return conv


def tenant_of_new(caller: Caller, requested: Optional[str]) -> Optional[str]:
    """The tenant of a conversation the caller creates: its own; the body's
    `tenant` only with the admin key. Raises Forbidden."""
    if requested is None or requested == caller.tenant:
        return caller.tenant
    if not caller.admin:
        raise Forbidden("the tenant comes from the API key: only the admin key may set 'tenant'")
    return requested


def tenant_tree(nodes: Iterable[NodeInfo], chains: dict[str, int], tenant: Optional[str],
                mine: set[str]) -> tuple[list[NodeInfo], dict[str, int]]:
    """What one tenant sees of the tree: the nodes of its namespaces (keys salted
    with its name; namespaces never share a node, so their parents are its own
    too), and nodes without a namespace (a lost host tail) that only its
    conversations (`mine`) hold; their owners and the chains limited to `mine`."""
    seen = []
    for n in nodes:
        if n.namespace is not None and n.cache_salt == tenant or (
                n.namespace is None and n.owners and all(o in mine for o in n.owners)):
            seen.append(dataclasses.replace(n, owners=tuple(o for o in n.owners if o in mine)))
    return seen, {cid: held for cid, held in chains.items() if cid in mine}
