"""Security headers on every response: no content sniffing, no framing, and
a Content-Security-Policy that allows nothing unless the route set its own
(the tree page allows its own script, stylesheet and data)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_CSP = b"default-src 'none'; frame-ancestors 'none'"
_ALWAYS = ((b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
           (b"referrer-policy", b"no-referrer"))


class SecurityHeaders:
    """Pure ASGI middleware (a streamed response passes through untouched)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def add(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in _ALWAYS if k not in names]
                if b"content-security-policy" not in names:
                    headers.append((b"content-security-policy", DEFAULT_CSP))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, add)
