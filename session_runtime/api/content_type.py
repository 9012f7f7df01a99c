"""Request bodies are JSON, and shallow: checked before a route reads them.

- A POST, PUT or PATCH that carries a body must say it is JSON
  (`Content-Type: application/json`, parameters such as `charset` allowed, or
  a `+json` type, which FastAPI parses as JSON too); else 415. Why: a web page
  may POST `text/plain` (or a form) to any origin without a CORS preflight, so
  without this check any page a user opens could run inference, or change
  conversations, on an open local server. A request without a body (Content-
  Length 0, or an empty chunked body) needs no type: `POST
  /admin/workers/{w}/drain` is sent that way.
- A JSON body nested deeper than MAX_DEPTH arrays and objects is refused as
  bad input (400 on the OpenAI and Anthropic routes, the session API's 422)
  before anything parses it: Python's json module, pydantic and the protocol
  adapters recurse per level, and a deep enough body makes them raise
  RecursionError (a 500) or spend the stack.

The body is read whole here (BodyLimit, outside, has bounded its size) and
handed on to the route as it came.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_runtime.api.errors import ApiError, error_response

# Deeper than any request of ours needs (a chat message with tool calls is ~6
# levels; a JSON Schema of tool parameters adds 2 per nested property), far
# below the ~1000 levels where Python's recursion limit is reached.
MAX_DEPTH = 64
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

# Opening brackets as +1, closing as -1 (0xff read as a signed byte); other bytes dropped.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def is_json(content_type: Optional[str]) -> bool:
    """`application/json` or `application/*+json`, with any parameters, in any case."""
    if content_type is None:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest in a JSON text; brackets inside strings
    do not count. Linear, with no Python loop over the bytes. For a text that
    is not JSON the figure means nothing, and the parser refuses the text anyway."""
    # Escapes first, so that every quote left delimits a string: an escaped
    # backslash (`\\`), then an escaped quote (`\"`).
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])  # every other piece lies inside a string
    steps = outside.translate(_STEPS, _NOT_BRACKETS)
    return max(accumulate(memoryview(steps).cast("b")), default=0)


async def read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole request body, and the messages it came in (to replay them to
    the app: a disconnect after the body too)."""
    received: list[Message] = []
    body = bytearray()
    while True:
        message = await receive()
        received.append(message)
        if message["type"] != "http.request":
            break  # the client left: the route sees that as it comes
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    return bytes(body), received


class JsonBodies:
    """Pure ASGI middleware (module docstring): 415 for a body that is not
    JSON, bad input for one nested deeper than MAX_DEPTH."""

    def __init__(self, app: ASGIApp, max_depth: int = MAX_DEPTH):
        self.app = app
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS or _header(scope, b"content-length") == "0":
            await self.app(scope, receive, send)
            return
        body, received = await read_body(receive)

        async def replay() -> Message:
            # The body as it came, then the client's next messages (a disconnect).
            return received.pop(0) if received else await receive()

        refusal = self._refusal(scope, body) if body else None
        if refusal is not None:
            await error_response(refusal, scope["path"])(scope, replay, send)
            return
        await self.app(scope, replay, send)

    def _refusal(self, scope: Scope, body: bytes) -> Optional[ApiError]:
        """Why a non-empty body is refused, or None when it may go on."""
        content_type = _header(scope, b"content-type")
        if not is_json(content_type):
            sent = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
            return ApiError(415, "unsupported_media_type",
                            f"the request body must be JSON (Content-Type: application/json); it came with {sent}")
        depth = nesting_depth(body)
        if depth > self.max_depth:
            return ApiError(422, "invalid_request", f"the request body nests arrays and objects {depth} levels deep; "
                                                    f"this server reads at most {self.max_depth}")
        return None


def _header(scope: Scope, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
