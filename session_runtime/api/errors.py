"""Error bodies of the HTTP edge, built in one place, in the shape of the
route's family:

- the session API (`/v1/conversations...`, `/debug/*`, `/admin/*`, the rest):
  `{"error": {"type", "message"}}` with its documented codes (422 for a
  malformed body);
- Anthropic Messages (`/v1/messages` and below): Anthropic's
  `{"type": "error", "error": {"type", "message"}}` with Anthropic's status
  codes (400, 401, 403, 404, 413, 429, 500, 529);
- the Gemini API (`/v1beta/...`, and its methods under `/v1/models/`): Google's `{"error": {"code", "message",
  "status"}}` with its status names (400 INVALID_ARGUMENT for bad input,
  404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, ...);
- the OpenAI-compatible routes (every other `/v1/...`): OpenAI's
  `{"error": {"message", "type", "param", "code"}}` with OpenAI's status codes
  (400 for a malformed body or bad input, 401, 404, ...).

Every error is first an ApiError (the session API's status and type), then
rendered for the route that failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_runtime.errors import RuntimeErrorBase


class Forbidden(RuntimeErrorBase):
    status = 403
    error_type = "forbidden"


class ModelNotFound(RuntimeErrorBase):
    """A request names a model this server does not serve (OpenAI: 404 model_not_found)."""

    status = 404
    error_type = "model_not_found"


@dataclass(frozen=True)
class ApiError:
    status: int  # the session API's
    kind: str  # the session API's type
    message: str
    param: Optional[str] = None  # the request field at fault, where one is
    headers: Mapping[str, str] = field(default_factory=dict)
    details: Optional[dict] = None  # upstream mode: the provider's error and what the stripper did

    @classmethod
    def of(cls, exc: RuntimeErrorBase) -> "ApiError":
        return cls(exc.status, exc.error_type, str(exc), getattr(exc, "param", None),
                   headers=getattr(exc, "headers", None) or {}, details=getattr(exc, "details", None))


def is_anthropic_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


GEMINI_METHODS = ("generateContent", "streamGenerateContent", "countTokens")


def is_gemini_route(path: str) -> bool:
    """`/v1beta/...`, and a Gemini method under `/v1/models/` (where the SDK sends it)."""
    return path.startswith("/v1beta/") or (path.startswith("/v1/models/") and ":" in path
                                           and path.rpartition(":")[2] in GEMINI_METHODS)


def is_openai_route(path: str) -> bool:
    return path.startswith("/v1/") and not (path == "/v1/conversations" or path.startswith("/v1/conversations/")
                                            or is_anthropic_route(path) or is_gemini_route(path))


# The session API's status -> OpenAI's status and type; others keep their
# status, as invalid_request_error (4xx) or server_error (5xx).
_OPENAI_STATUS = {
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    422: (400, "invalid_request_error"),  # a malformed body or bad input
    507: (503, "server_error"),  # the KV pool or the store is full: OpenAI has no 507
}
# The session API's type -> OpenAI's code (None: OpenAI's null); others as they are.
_OPENAI_CODE = {"context_too_long": "context_length_exceeded", "unauthorized": "invalid_api_key",
                "invalid_request": None, "validation_error": None, "internal": None}


def openai_body(err: ApiError) -> tuple[int, dict]:
    """(OpenAI's status, its error object) for an ApiError."""
    default = (err.status, "invalid_request_error" if err.status < 500 else "server_error")
    status, kind = _OPENAI_STATUS.get(err.status, default)
    if err.kind == "context_too_long":
        status = 400  # OpenAI answers a prompt over the context with 400 context_length_exceeded
    body = {"message": err.message, "type": kind, "param": err.param, "code": _OPENAI_CODE.get(err.kind, err.kind)}
    if err.details is not None:
        body["upstream"] = err.details
    return status, body


# The session API's status -> Anthropic's status and type; other 4xx keep
# their status as invalid_request_error (Anthropic's docs say so), other 5xx
# are 500 api_error.
_ANTHROPIC_STATUS = {
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    422: (400, "invalid_request_error"),  # a malformed body or bad input
    429: (429, "rate_limit_error"),
    # Nothing is wrong with the request; it may be sent again later: Anthropic's
    # "overloaded", which its SDK retries.
    502: (529, "overloaded_error"),
    503: (529, "overloaded_error"),
    507: (529, "overloaded_error"),  # the KV pool or the store is full
}


def anthropic_body(err: ApiError) -> tuple[int, dict]:
    """(Anthropic's status, its whole error body) for an ApiError."""
    default = (err.status, "invalid_request_error") if err.status < 500 else (500, "api_error")
    status, kind = _ANTHROPIC_STATUS.get(err.status, default)
    if err.kind == "context_too_long":
        status, kind = 400, "invalid_request_error"  # Anthropic: 400 "prompt is too long"
    error = {"type": kind, "message": err.message}
    if err.details is not None:
        error["upstream"] = err.details
    return status, {"type": "error", "error": error}


# The session API's status -> Google's: a malformed body or bad input is 400,
# a full pool or store 503 (UNAVAILABLE, which Gemini CLI retries).
_GEMINI_STATUS = {422: 400, 413: 400, 502: 503, 507: 503}


def gemini_body(err: ApiError) -> tuple[int, dict]:
    """(Google's status, its whole error body) for an ApiError."""
    from session_runtime.protocols.gemini import error

    status = 400 if err.kind == "context_too_long" else _GEMINI_STATUS.get(err.status, err.status)
    body = error(status, err.message, err.kind).body
    if err.details is not None:
        body["error"]["upstream"] = err.details
    return status, body


def session_body(err: ApiError) -> dict:
    body = {"type": err.kind, "message": err.message}
    if err.details is not None:
        body["upstream"] = err.details
    return body


def error_response(err: ApiError, path: str) -> JSONResponse:
    """`err` as the error response of the family `path` belongs to."""
    if is_anthropic_route(path):
        status, content = anthropic_body(err)
    elif is_gemini_route(path):
        status, content = gemini_body(err)
    elif is_openai_route(path):
        status, body = openai_body(err)
        content = {"error": body}
    else:
        status, content = err.status, {"error": session_body(err)}
    # A client error will fail the same way again: tell the SDKs (OpenAI's and
    # Anthropic's both read this header) not to retry it.
    extra = {"x-should-retry": "false"} if 400 <= status < 500 else {}
    return JSONResponse(status_code=status, content=content, headers={**extra, **err.headers})


class InternalErrors:
    """Pure ASGI middleware: an exception no handler took (a bug) becomes a 500
    that says "internal error"; its text and traceback go to the log only.
    Answered here, inside Starlette's ServerErrorMiddleware, because that one
    re-raises to the HTTP server, which then drops the connection under the
    client. A response already under way cannot change its status: that
    exception goes on up, and the server closes the connection."""

    def __init__(self, app: ASGIApp, on_error: Callable[[], None] = lambda: None):
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            logging.getLogger("session_runtime").error("internal error on %s %s", scope["method"], scope["path"],
                                                       exc_info=exc)
            self.on_error()
            if started:
                raise
            await error_response(ApiError(500, "internal", "internal error"), scope["path"])(scope, receive, send)
