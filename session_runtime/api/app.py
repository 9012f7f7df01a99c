"""create_app(runtime, settings): the session HTTP API (DESIGN.md section 8).

Every error maps once, here, to `{error: {type, message}}` with a 4xx (or 507
for an exhausted pool), or to OpenAI's error on the OpenAI-compatible routes,
Anthropic's on `/v1/messages` (api/errors.py); a failed request changes
nothing because the runtime commits only after a step succeeds. The API key
names the caller (api/auth.py); a conversation of another tenant is answered
as one that does not exist. A request body must be JSON, and not deeply
nested (api/content_type.py).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
from typing import Optional

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from session_runtime.api.auth import AccessLog, Authenticate, CheckHost, current_caller, tenant_of_new, tenant_tree, visible
from session_runtime.api.content_type import JsonBodies
from session_runtime.api.errors import ApiError, InternalErrors, error_response
from session_runtime.api.forward import Forward
from session_runtime.api.lean_route import lean_post
from session_runtime.api.limits import BodyLimit
from session_runtime.api.openai_compat import build_router
from session_runtime.api import gemini_route, messages_route, responses_route
from session_runtime.api.settings import ApiSettings, Caller
from session_runtime.api.streaming import cancellable, sse_step
from session_runtime.api.security_headers import SecurityHeaders
from session_runtime.api.tree_page import tree_page_router
from session_runtime.api.schemas import CreateConversation, SendMessage, SendToolResults
from session_runtime.errors import ConversationNotFound, OwnedElsewhere, RuntimeErrorBase
from session_runtime.metrics import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE, Metrics
from session_runtime.runtime import Runtime
from session_runtime.server_secret import ServerSecret

def _param(errors: list[dict]) -> Optional[str]:
    """The field at fault in a validation error (`max_tokens`, `messages.0`),
    without the leading `body` or `query`."""
    loc = [str(p) for p in errors[0]["loc"][1:]] if errors else []
    return ".".join(loc) or None


def _version() -> str:
    try:
        return importlib.metadata.version("session-runtime")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def create_app(runtime: Runtime, settings: Optional[ApiSettings] = None) -> FastAPI:
    settings = settings or ApiSettings()
    # /docs and /redoc would load their scripts from a CDN: off. /openapi.json stays.
    app = FastAPI(title="session-runtime", version=_version(), docs_url=None, redoc_url=None)
    metrics = Metrics()
    app.state.runtime = runtime
    app.state.metrics = metrics
    app.state.settings = settings
    # Signs thinking and encrypts reasoning handed to clients (Messages, Responses); kept with the data.
    app.state.secret = ServerSecret.load(runtime.config.data_dir)
    # Added last runs first: the Host, then the key, are checked before the body is read at all;
    # the body's type and depth once BodyLimit has bounded its size.
    app.add_middleware(InternalErrors, on_error=metrics.record_error)
    app.add_middleware(Forward, runtime=runtime)  # in a fleet: to the process that owns the conversation
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(Authenticate, settings=settings)
    app.add_middleware(CheckHost, allowed=settings.allowed_hosts)
    app.add_middleware(AccessLog)
    app.add_middleware(SecurityHeaders)  # outermost: refusals and errors carry the headers too

    @app.exception_handler(RuntimeErrorBase)
    def _runtime_error(request: Request, exc: RuntimeErrorBase) -> JSONResponse:
        if not isinstance(exc, OwnedElsewhere):  # relayed by api/forward.py, not answered
            metrics.record_error()
        return error_response(ApiError.of(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors]
        return error_response(ApiError(422, "validation_error", "; ".join(parts), param=_param(errors)),
                              request.url.path)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own answers (no such route, a wrong method), in our shape.
        method, path = request.method, request.url.path
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        if exc.status_code == 404:
            err = ApiError(404, "not_found", f"no route {method} {path}")
        elif exc.status_code == 405:
            # Starlette names the first route of the path only; a path may have several (GET and POST).
            allowed = sorted({m for r in app.router.routes if getattr(r, "methods", None)
                              and getattr(r, "path_regex", None) and r.path_regex.match(path) for m in r.methods})
            headers["allow"] = ", ".join(allowed) or headers.get("allow", "")
            err = ApiError(405, "method_not_allowed",
                           f"{method} is not allowed on {path} (allowed: {headers.get('allow', '')})", headers=headers)
        else:
            err = ApiError(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal",
                           str(exc.detail), headers=headers)
        return error_response(err, path)

    @app.get("/version")
    def version() -> dict:
        return {"version": _version()}

    @app.get("/health")
    def health():
        up = runtime.backend.available()
        body = {"status": "ok" if up else "backend_unavailable", "model": runtime.model_id,
                "device": runtime.config.device, "backend": runtime.backend.name}
        if hasattr(runtime.backend, "describe_workers"):
            body["workers"] = runtime.backend.describe_workers()
        if runtime.fleet is not None:  # which process answered, and the others it knows are live
            body["member"], body["members"] = runtime.fleet.id, runtime.fleet.live()
        return body if up else JSONResponse(body, status_code=503)

    @app.post("/v1/conversations", status_code=201)
    def create(body: CreateConversation, caller: Caller = Depends(current_caller)) -> dict:
        fields = body.model_dump()
        fields["tenant"] = tenant_of_new(caller, body.tenant)
        cid = runtime.create_conversation(**fields)
        return runtime.describe(cid)

    @app.get("/v1/conversations")
    def listing(after: Optional[str] = None, limit: int = Query(100, ge=1, le=1000),
                caller: Caller = Depends(current_caller)) -> dict:
        """The caller's conversations (the admin key: every tenant's), explicit and inferred, by id."""
        return runtime.list_conversations(caller.tenant, everyone=caller.admin, after=after, limit=limit)

    @app.get("/v1/conversations/{cid}")
    def get(cid: str, tokens: int = 0, caller: Caller = Depends(current_caller)) -> dict:
        visible(runtime, cid, caller)
        return runtime.describe(cid, tokens=bool(tokens))

    @app.delete("/v1/conversations/{cid}")
    def delete(cid: str, caller: Caller = Depends(current_caller)) -> dict:
        visible(runtime, cid, caller)
        runtime.delete_conversation(cid)
        return {"id": cid, "deleted": True}

    def timed(call, *args, **kwargs) -> JSONResponse:
        t0 = time.perf_counter()
        step = call(*args, **kwargs)
        metrics.record_step(step.accounting, (time.perf_counter() - t0) * 1e3)
        return JSONResponse(step.as_dict())  # plain JSON values: no jsonable_encoder walk on the step path

    def respond(call, cid: str, first_arg, body, caller: Caller, cancel):
        conv = visible(runtime, cid, caller)  # 404 before any stream starts
        options = body.options()
        if not body.stream:
            return timed(call, cid, first_arg, cancel=cancel, **options)

        def run(on_token, stream_cancel, on_prefill=None):
            t0 = time.perf_counter()
            step = call(cid, first_arg, on_token=on_token, cancel=stream_cancel, **options)
            metrics.record_step(step.accounting, (time.perf_counter() - t0) * 1e3)
            return step

        # An error before the first token reaches the exception handlers (counted
        # there); one after it is an event, counted as it is sent.
        return StreamingResponse(sse_step(run, runtime.template(conv.template), cancel=cancel,
                                          on_late_error=metrics.record_error, stop=options["constraint"].stop),
                                 media_type="text/event-stream")

    # A step's client that disconnects, plain or streamed, cancels it (`cancellable`).
    # The step routes' requests are read by a lean handler (api/lean_route.py: FastAPI's answers, less CPU).
    @lean_post(app, "/v1/conversations/{cid}/messages")
    async def message(cid: str, body: SendMessage, request: Request, caller: Caller = Depends(current_caller)):
        return await cancellable(request, lambda cancel: respond(
            runtime.send_message, cid, body.content, body, caller, cancel))

    @lean_post(app, "/v1/conversations/{cid}/tool_results")
    async def tool_results(cid: str, body: SendToolResults, request: Request, caller: Caller = Depends(current_caller)):
        return await cancellable(request, lambda cancel: respond(
            runtime.send_tool_results, cid, [r.model_dump() for r in body.results], body, caller, cancel))

    chat = build_router(runtime, metrics.record_step, metrics.record_error, settings.validate)
    app.include_router(chat)
    if runtime.backend.name != "upstream":  # Anthropic Messages, OpenAI Responses and Gemini, answered here
        for route in (messages_route, responses_route, gemini_route):  # api/protocol_routes.py: what they share
            app.include_router(route.build(chat.answers, settings.validate, runtime))

    @app.post("/admin/workers/{wid}/drain")
    def drain(wid: str) -> dict:
        """Many workers: place nothing more on `wid` and hand its conversations to
        the others now (their next steps prefill there)."""
        moved = runtime.drain_worker(wid)
        return {"worker": wid, "moved": moved, "workers": runtime.backend.describe_workers()}

    @app.get("/debug/tree")
    def tree(conversation: str | None = None, worker: str | None = None, check: bool = False,
             caller: Caller = Depends(current_caller)) -> dict:
        """The tree; a tenant sees only its own nodes and chains, the admin all.
        `check=true` (the admin's): the integrity check too (on SGLang, every
        tensor-parallel rank's tree compared)."""
        if conversation is not None:
            visible(runtime, conversation, caller)
        nodes, chains = runtime.tree_snapshot(conversation, worker), runtime.chains()
        if not caller.admin:
            nodes, chains = tenant_tree(nodes, chains, caller.tenant, runtime.conversations_of(caller.tenant))
        body = {
            "page_size": runtime.config.page_size,
            "nodes": [dataclasses.asdict(n) for n in nodes],
            "chains": chains,
            "conversations": chain_views(runtime, [c for c in chains if conversation in (None, c)]),
        }
        if runtime.fleet is not None:  # the process answering (a conversation's: its owner, api/forward.py)
            body["member"] = runtime.fleet.id
        if check and caller.admin:
            body["integrity"] = runtime.integrity()
        return body

    app.include_router(tree_page_router())

    def chain_views(runtime, ids) -> list[dict]:
        views = []
        for cid in ids:
            try:
                views.append(runtime.chain_view(cid))
            except ConversationNotFound:  # deleted since the chains were read
                pass
        return views

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(runtime.metric_samples()), media_type=PROMETHEUS_CONTENT_TYPE)

    return app
