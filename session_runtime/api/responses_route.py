"""`POST /v1/responses`: OpenAI Responses, served by the local engine through the chat
route (api/protocol_routes.py has what the protocol routes share)."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter

from session_runtime.api.protocol_routes import answer_stateless

PATH = "/v1/responses"
PROTOCOL = "openai-responses"


def build(chat_router, validate: Optional[str], model_id: str) -> APIRouter:
    router = APIRouter()
    router.post(PATH, name=PROTOCOL)(answer_stateless(PATH, PROTOCOL, chat_router, validate, model_id))
    return router
