"""The request body limit: a body over `max_bytes` gets 413 before the route
reads or parses it, so it changes nothing and costs no tokenizing.

A Content-Length over the limit is refused at once, unread. A body without
one (chunked) is read here up to the limit: 413 as soon as it passes it, else
the route gets the bytes as they came.
"""

from __future__ import annotations

from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_runtime.api.errors import ApiError, error_response


class BodyLimit:
    """Pure ASGI middleware."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:  # the server holds the body to its declared length
            if length > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break  # the client left: the route sees that as it comes
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            # The body as it came, then the client's next messages (a disconnect).
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over this server's limit of {self.max_bytes} bytes (--max-body-bytes)"
        response = error_response(ApiError(413, "request_too_large", message, headers={"connection": "close"}),
                                  scope["path"])
        await response(scope, receive, send)


def _content_length(scope: Scope) -> Optional[int]:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length before we see it
    return None
