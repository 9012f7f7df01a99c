"""The OpenAI chat route's two provider modes.

- Upstream proxy (`--upstream`): a chat completion without `conversation_id`
  is the client's own transcript, reasoning and all; it goes to the provider
  through the outbound stripper and the provider's answer comes back as it
  came, plus our accounting (`accounting.upstream`, also in the
  `x-session-runtime-stripper` header, which a streamed answer has too).
- Validating upstream (`--validate PROTOCOL`): a request is first checked as
  that provider's API checks it, and refused with the provider's own status
  and error body; a request that passes is answered by the local engine. The
  shapes only a provider accepts (a request that ends on an assistant draft,
  a system message after the first) are made answerable first: see `answerable`.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from fastapi.responses import JSONResponse, StreamingResponse

from session_runtime.protocols import get_protocol

STRIPPER_HEADER = "x-session-runtime-stripper"


def request_body(body) -> dict:
    """The request as the client sent it (fields it did not send stay out)."""
    return body.model_dump(exclude_unset=True)


def proxy_completion(backend, body: dict, record_step: Callable) -> object:
    """Forward a stateless chat completion upstream; the provider's body (or
    stream) comes back. Raises UpstreamError / UpstreamUnavailable / InvalidRequest."""
    if body.get("stream"):
        status, chunks, account = backend.forward_stream(body)
        headers = {STRIPPER_HEADER: json.dumps(account.as_dict(), separators=(",", ":"))}
        return StreamingResponse(chunks, status_code=status, media_type="text/event-stream", headers=headers)
    forwarded, completion, acc = backend.forward_chat(body)
    record_step(acc, forwarded.elapsed_ms)
    headers = {STRIPPER_HEADER: json.dumps(forwarded.strip.as_dict(), separators=(",", ":"))}
    return JSONResponse(completion, headers=headers)


def validation_error(protocol: Optional[str], body: dict) -> Optional[JSONResponse]:
    """The provider's refusal of `body`, in its own status and body; None when it passes."""
    if protocol is None:
        return None
    err = get_protocol(protocol).validate(body)
    if err is None:
        return None
    return JSONResponse(err.body, status_code=err.status, headers={"x-session-runtime-validator": err.name})


def answerable(messages: list[dict]) -> list[dict]:
    """A valid provider request's messages in the shape the local engine runs
    (its last message a user message or tool results, one system message
    first): a system message after the first goes in as a user message (the
    provider reads a nudge the same way), consecutive user messages are joined
    by a blank line, and a request that ends on an assistant message (a draft
    to continue) gets a user message asking to continue."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer") and i > 0:
            m = {"role": "user", "content": m.get("content")}
        if out and m.get("role") == "user" and out[-1].get("role") == "user":
            out[-1] = {"role": "user", "content": _join(out[-1].get("content"), m.get("content"))}
            continue
        out.append(m)
    if out and out[-1].get("role") == "assistant":
        out.append({"role": "user", "content": "Continue."})
    return out


def _join(a: object, b: object) -> str:
    from session_runtime.importer import text_content

    return "\n\n".join(t for t in (text_content(a), text_content(b)) if t)
