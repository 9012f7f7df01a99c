"""The errors of `/v1/responses` that no other route raises, with the codes
OpenAI's Responses API answers them with (rendered once at the edge, api/errors.py)."""

from __future__ import annotations

from session_runtime.errors import RuntimeErrorBase


class PreviousResponseNotFound(RuntimeErrorBase):
    """`previous_response_id` names no stored response the caller may see
    (unknown, deleted, another tenant's, or its conversation is gone)."""

    status = 404
    error_type = "previous_response_not_found"
    param = "previous_response_id"

    def __str__(self) -> str:
        return f"Previous response with id {self.args[0]!r} not found."


class ResponseNotFound(RuntimeErrorBase):
    """GET or DELETE of a response that is not stored (or another tenant's)."""

    status = 404
    error_type = "not_found"

    def __str__(self) -> str:
        return f"Response with id {self.args[0]!r} not found."


class PreviousResponseNotLatest(RuntimeErrorBase):
    """A fork: `previous_response_id` is a stored response, but its conversation
    has moved on past it (this server continues a conversation only from its end)."""

    status = 409
    error_type = "previous_response_not_latest"
    param = "previous_response_id"


class ResponseInProgress(RuntimeErrorBase):
    """Another response of the same conversation is still being answered."""

    status = 409
    error_type = "conversation_locked"
    param = "previous_response_id"


class InvalidEncryptedContent(RuntimeErrorBase):
    """A reasoning item's `encrypted_content` that this server did not make
    (tampered, foreign, or made under another server secret)."""

    status = 400
    error_type = "invalid_encrypted_content"
    param = "input"
