"""Any runtime process of a fleet answers any route (store/fleet.py): a request for
a conversation another process owns is forwarded to it, once, and its
answer (streams included) relayed as it comes.

The conversation of a request is read from the path
(`/v1/conversations/{id}...`), from `conversation_id` in a chat completion's
body, or from `/debug/tree?conversation=`. A stateless request names none:
the route finds its conversation by its history (stateless.py), and when
another process owns that one, answers OwnedElsewhere, whose response this
middleware swallows to relay the request there instead (or passes on as a
503 when the request was relayed once already). A forwarded request carries
`x-session-runtime-forwarded` and is never relayed again: where it lands,
the conversation is taken over if its owner is gone (the relaying process
found this one its first choice), or refused with a 503 if another process
took it meanwhile. Every response names the process that served it
(`x-session-runtime-member`); a relayed one also names the process that
relayed it (`x-session-runtime-via`). An owner that cannot be reached (it
died, and its beat has not lapsed yet) is a 503 with Retry-After. One that
refused the connection (nothing listens at its address: its process is gone)
is struck from the members at once (`Fleet.unreachable`), so the
conversation's next request takes it over without waiting for the beat to
lapse; one that timed out waits for that.

Pure ASGI middleware, inside the body checks (the body is read once here,
already bounded and checked) and the key check (the owner checks the
relayed key again).
"""

from __future__ import annotations

import json
import math
import re
from typing import Optional
from urllib.parse import parse_qs

import httpx
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_runtime.api.auth import _header
from session_runtime.api.content_type import read_body
from session_runtime.api.errors import ApiError, error_response
from session_runtime.errors import OwnedElsewhere, StorageUnavailable
from session_runtime.store.fleet import Route

FORWARDED = b"x-session-runtime-forwarded"
MEMBER = b"x-session-runtime-member"
VIA = b"x-session-runtime-via"
_PATH = re.compile(r"^/v1/conversations/([^/]+)")
_RELAY = OwnedElsewhere.RELAY.encode()
_HOP = {b"connection", b"keep-alive", b"transfer-encoding"}  # hop-by-hop: never relayed
_SET_BY_CLIENT = {b"host", b"content-length"}  # httpx writes the relayed request's own


class Forward:
    def __init__(self, app: ASGIApp, runtime):
        self.app, self.runtime = app, runtime
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0)) if runtime.fleet else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fleet = self.runtime.fleet
        if scope["type"] != "http" or fleet is None:
            await self.app(scope, receive, send)
            return
        relayed = _header(scope, FORWARDED) is not None
        received: list[Message] = []
        body = b""
        if scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            body, received = await read_body(receive)

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        cid = conversation_of(scope, body)
        route = None
        if cid is not None:
            try:
                route = fleet.owned(cid) or await run_in_threadpool(fleet.route, cid, relayed)
                if route.url is None and (route.claimed or cid not in self.runtime.conversations):
                    await run_in_threadpool(self.runtime.take, cid, route.claimed)
            except Exception as exc:  # the store is away
                await self._unavailable(scope, send, f"cannot tell which runtime process serves conversation "
                                                     f"{cid!r}: {exc}")
                return
        if route is None or route.url is None:
            relay_to = await self._serve(scope, replay, send, relayed)
            if relay_to is not None:
                owner, _, url = relay_to.partition(" ")
                await self._relay(scope, body, Route(owner, url), send)
            return
        if relayed:  # relayed once already, and another member took it meanwhile: never twice
            await self._unavailable(scope, send, f"conversation {cid!r} moved to runtime process {route.owner} "
                                                 "while this request was relayed; retry")
            return
        await self._relay(scope, body, route, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, relayed: bool) -> Optional[str]:
        """Serve the request here. Returns "owner url" instead when the route
        answered OwnedElsewhere to a request not relayed yet (that answer
        swallowed); once relayed, the answer goes out as the 503 it is."""
        stamped = _stamped(send, MEMBER, self.runtime.fleet.id)
        relay_to: Optional[str] = None

        async def watch(message: Message) -> None:
            nonlocal relay_to
            if message["type"] == "http.response.start":
                headers = message.get("headers", ())
                found = next((v for k, v in headers if k.lower() == _RELAY), None)
                if found is not None and not relayed:
                    relay_to = found.decode("latin-1")
                    return
                message = {**message, "headers": [(k, v) for k, v in headers if k.lower() != _RELAY]}
            elif relay_to is not None:
                return  # the swallowed answer's body
            await stamped(message)

        await self.app(scope, receive, watch)
        return relay_to

    async def _relay(self, scope: Scope, body: bytes, route, send: Send) -> None:
        me = self.runtime.fleet.id
        query = scope.get("query_string", b"").decode("latin-1")
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")  # as the client encoded it
        url = route.url.rstrip("/") + path + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in _HOP | _SET_BY_CLIENT]
        headers.append((FORWARDED, me.encode()))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except _UNSENT as exc:  # nothing reached the owner: nothing changed, send it again later
            if isinstance(exc, httpx.ConnectError):  # refused: it is gone; taken over at the next request
                try:
                    await run_in_threadpool(self.runtime.fleet.unreachable, route.owner)
                except StorageUnavailable:
                    pass  # the store is away too: its beat's TTL decides
            await self._unavailable(scope, send, f"the runtime process serving this conversation ({route.owner} at "
                                                 f"{route.url}) cannot be reached ({type(exc).__name__}); another "
                                                 "takes it over at once (send it again)")
            return
        except httpx.HTTPError as exc:
            # The owner had the request and stopped answering (killed mid-step): it
            # may have stored the step before it died, so this is no "nothing changed".
            await self._lost(scope, send, f"the runtime process serving this conversation ({route.owner} at "
                                          f"{route.url}) stopped answering during the request ({type(exc).__name__}): "
                                          "the step may have been stored; read the conversation before sending it "
                                          "again")
            return
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP]  # raw bytes: their length too
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [*out, (VIA, me.encode())]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _unavailable(self, scope: Scope, send: Send, message: str) -> None:
        retry = str(math.ceil(self.runtime.fleet.ttl))
        await self._error(scope, send, ApiError(503, "unavailable", message, headers={"retry-after": retry}))

    async def _lost(self, scope: Scope, send: Send, message: str) -> None:
        await self._error(scope, send, ApiError(502, "owner_lost", message))

    async def _error(self, scope: Scope, send: Send, err: ApiError) -> None:
        await error_response(err, scope["path"])(scope, _nothing, _stamped(send, MEMBER, self.runtime.fleet.id))


# Errors before the request reached the owner (no connection, or none free):
# the owner never saw it. Any other error may come after it did.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def conversation_of(scope: Scope, body: bytes) -> Optional[str]:
    """The conversation a request is about, if any."""
    m = _PATH.match(scope["path"])
    if m is not None:
        return m.group(1)
    if scope["path"] == "/v1/chat/completions" and body:
        try:
            cid = json.loads(body).get("conversation_id")
        except (ValueError, AttributeError):
            return None  # the route refuses it
        return cid if isinstance(cid, str) and cid else None
    if scope["path"] == "/debug/tree":
        found = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("conversation")
        return found[0] if found else None
    return None


def _stamped(send: Send, name: bytes, value: str) -> Send:
    async def stamped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (name, value.encode())]}
        await send(message)
    return stamped


async def _nothing() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
