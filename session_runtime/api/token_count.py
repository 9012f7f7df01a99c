"""How many prompt tokens a chat request renders to, without running it
(`POST /v1/messages/count_tokens`).

The request is adopted as the chat route adopts a stateless request, in a
throw-away conversation (same checks, same template, same reasoning policy),
and its prompt rendered as the step would render it; the conversation is
deleted again, no KV is computed. The count therefore equals the step's
`prompt_tokens` (cached or not) for the same request.
"""

from __future__ import annotations

from typing import Optional

from session_runtime import continuation
from session_runtime.policies import ReasoningPolicy
from session_runtime.tool_clearing import Cleared


def prompt_tokens(runtime, messages: list[dict], tools, tenant, policy: Optional[ReasoningPolicy] = None,
                  cleared: Optional[Cleared] = None) -> int:
    """The prompt tokens of chat `messages` and `tools` for `tenant`, the
    earlier turns' reasoning kept as `policy` says (None: the server's), the
    `cleared` tool uses cleared (tool_clearing.py). Changes
    nothing that outlives the call. Raises what the chat route raises for the
    same history (InvalidRequest, ContextTooLong, TooManyConversations, ...),
    and ToolCallConflict for tool results that answer no pending call."""
    request = continuation.split(messages, tools)
    chosen = {"policy": policy.name, "keep_last_k": policy.keep_last_k} if policy is not None else {}
    cid = runtime.create_conversation(request.system, stateless=True, tools=request.tools, tenant=tenant,
                                      history=request.history, **chosen)
    try:
        return runtime.prompt_tokens(cid, request, cleared)
    finally:
        runtime.delete_conversation(cid)
