"""What `/v1/responses` does to a request's input before the chat route runs
it: reasoning items the server encrypted come back decrypted, and a request
that continues a stored response (`previous_response_id`) is cut to the chat
route's "only the new input" shape (continuation.py)."""

from __future__ import annotations

from typing import Optional

from session_runtime import continuation
from session_runtime.api.responses_errors import InvalidEncryptedContent
from session_runtime.errors import InvalidRequest
from session_runtime.importer import text_content
from session_runtime.server_secret import ServerSecret

ENCRYPTED = "reasoning.encrypted_content"


def decrypt_reasoning(raw: object, secret: ServerSecret) -> object:
    """`raw` with each input reasoning item that carries `encrypted_content`
    replaced by the same item with its reasoning text recovered (as a
    `reasoning_text` part): the encrypted text is what the server said, so it
    wins over any readable part sent with it. Changes nothing in `raw`.
    Raises InvalidEncryptedContent for a token this server did not make."""
    if not isinstance(raw, dict) or not isinstance(raw.get("input"), list):
        return raw
    items = []
    for i, item in enumerate(raw["input"]):
        if isinstance(item, dict) and item.get("type") == "reasoning" and item.get("encrypted_content") is not None:
            text = secret.decrypt(item["encrypted_content"])
            if text is None:
                raise InvalidEncryptedContent(
                    f"input[{i}]: the encrypted content of reasoning item {item.get('id')!r} could not be verified: "
                    "this server did not make it, or it was changed", param=f"input[{i}].encrypted_content")
            item = {k: v for k, v in item.items() if k != "encrypted_content"}
            item["content"] = [{"type": "reasoning_text", "text": text}]
        items.append(item)
    return {**raw, "input": items}


def only_new_input(messages: list[dict], system: Optional[str], calls: dict[str, str]) -> list[dict]:
    """The chat messages of a request that continues a stored conversation
    whose system prompt is `system`: only its new input (one user message, or
    the tool results answering the previous response's calls, their call_ids
    mapped back to the runtime's through `calls`), so that the step prefills
    only that. Raises InvalidRequest for `instructions` other than the
    conversation's (its system prompt is the first thing its KV holds) and for
    input that is more than new input."""
    rest = list(messages)
    if rest and rest[0].get("role") in ("system", "developer"):
        sent = text_content(rest.pop(0).get("content"), "instructions") or None
        if sent != system:
            raise InvalidRequest(
                "instructions differ from those of the conversation previous_response_id continues: this server "
                "keeps a stored conversation's system prompt for all its turns (its cache starts with it); send the "
                "same instructions or none, or start a new conversation without previous_response_id",
                param="instructions")
    try:
        split = continuation.split(rest, None)
    except InvalidRequest as exc:
        raise InvalidRequest(f"input: {exc}", param="input") from None
    if split.history:
        raise InvalidRequest(
            "with previous_response_id, input holds only the new input: user message items, or the "
            "function_call_output items answering the previous response's calls (the earlier turns are stored)",
            param="input")
    return [{**m, "tool_call_id": calls.get(m.get("tool_call_id"), m.get("tool_call_id"))}
            if m.get("role") == "tool" else m for m in split.new]
