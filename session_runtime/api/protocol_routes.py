"""Anthropic Messages (`POST /v1/messages`) and OpenAI Responses
(`POST /v1/responses`) served inbound by the local engine.

A request is parsed by its protocol adapter, checked as that provider checks
it when the server runs `--validate` for it (refused with the provider's own
status and body), converted to a chat history (roles, text, reasoning, tool
calls and results: protocols/convert.py) and answered by the chat route's
step, in a throw-away conversation; the answer is written back in the
protocol's response shape. Stateless and not streamed: a conversation's chain
is the session API's or `/v1/chat/completions`'s.
"""

from __future__ import annotations

import json
from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from session_runtime.api.auth import current_caller
from session_runtime.api.proxy_routes import answerable, validation_error
from session_runtime.api.settings import Caller
from session_runtime.api.streaming import cancellable
from session_runtime.errors import InvalidRequest
from session_runtime.protocols import ProtocolInputError, get_protocol
from session_runtime.protocols.canonical import Msg, Reply, Usage
from session_runtime.protocols.convert import to_chat

ROUTES = {"/v1/messages": "anthropic", "/v1/responses": "openai-responses"}


def build_protocol_routes(chat_router, validate: Optional[str], model_id: str) -> APIRouter:
    """The routes of ROUTES, answering through `chat_router.complete`."""
    router = APIRouter()

    def route(path: str, protocol: str) -> None:
        adapter = get_protocol(protocol)

        @router.post(path, name=protocol)
        async def answer(request: Request, caller: Caller = Depends(current_caller)):
            try:
                raw = json.loads(await request.body())
            except ValueError as exc:
                raise InvalidRequest(f"the body is not JSON: {exc}") from None
            if validate == protocol:
                refused = validation_error(protocol, raw)
                if refused is not None:
                    return refused
            if isinstance(raw, dict) and raw.get("stream"):
                raise InvalidRequest(f"streaming is not served on {path}; use /v1/chat/completions", param="stream")
            chat = _chat_request(adapter, protocol, raw)
            result = await cancellable(request, lambda cancel: chat_router.complete(chat, caller, cancel))
            if not isinstance(result, dict):
                return result  # a refusal already in its final shape
            return JSONResponse(adapter.render_response(_reply(result), model_id))

    for path, protocol in ROUTES.items():
        route(path, protocol)
    return router


def _chat_request(adapter, protocol: str, raw: object):
    """The chat route's request for a body of `protocol`. Raises InvalidRequest
    naming the field the protocol could not read."""
    from session_runtime.api.openai_compat import ChatRequest

    try:
        parsed = adapter.parse_request(raw)
    except ProtocolInputError as exc:
        raise InvalidRequest(str(exc), param=exc.path) from None
    chat = get_protocol("openai-chat").render_request(to_chat(parsed, protocol, "openai-chat"))
    chat.pop("model", None)  # the provider's model name: this server answers with its own
    chat["messages"] = answerable(chat.get("messages") or [])
    if chat.get("max_tokens") is None:
        chat.pop("max_tokens", None)
    return ChatRequest(**chat)


def _reply(completion: dict) -> Reply:
    """Our chat completion as a canonical reply (reasoning, text, tool calls, usage)."""
    reply = get_protocol("openai-chat").parse_response({k: v for k, v in completion.items()
                                                        if k not in ("accounting", "conversation_id")})
    m = reply.message
    message = Msg("assistant", m.content or "", m.reasoning, m.calls)  # fresh layout: the target's default
    usage = reply.usage or Usage(0, 0)
    return Reply(message, Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_input_tokens),
                 reply.finish_reason, reply.id)
