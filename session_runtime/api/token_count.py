"""How many prompt tokens a chat request renders to, without running it
(`POST /v1/messages/count_tokens`).

The request is adopted as the chat route adopts a stateless request, in a
throw-away conversation (same checks, same template, same reasoning policy),
and its prompt rendered as the step would render it; the conversation is
deleted again, no KV is computed. The count therefore equals the step's
`prompt_tokens` (cached or not) for the same request.
"""

from __future__ import annotations

from session_runtime import continuation
from session_runtime.conversation import Conversation
from session_runtime.errors import InvalidRequest, ToolCallConflict
from session_runtime.templates.base import Message


def prompt_tokens(runtime, messages: list[dict], tools, tenant) -> int:
    """The prompt tokens of chat `messages` and `tools` for `tenant`. Changes
    nothing that outlives the call. Raises what the chat route raises for the
    same history (InvalidRequest, ContextTooLong, TooManyConversations, ...),
    and ToolCallConflict for tool results that answer no pending call."""
    request = continuation.split(messages, tools)
    cid = runtime.create_conversation(request.system, stateless=True, tools=request.tools, tenant=tenant,
                                      history=request.history)
    try:
        conv = runtime.get(cid)
        tpl = runtime.template(conv.template)
        keep = conv.policy.kept_turns(conv.closed_turns)
        return len(tpl.render(conv.system, conv.tools, conv.history + _new(conv, request), keep, True).ids)
    finally:
        runtime.delete_conversation(cid)


def _new(conv: Conversation, request: continuation.ChatInput) -> list[Message]:
    """The new input as the step appends it: a user message opening the next
    turn, or the results in the order of the pending calls (as Runtime's
    results step orders them)."""
    content = request.user_content
    if content is not None:
        if not content.strip():
            raise InvalidRequest("message content must be a non-empty string")
        return [Message("user", len(conv.turns), content)]
    if conv.protocol is None:
        raise ToolCallConflict("no tool call is pending in this conversation")
    by_id = {r["tool_call_id"]: r["content"] for r in request.tool_results()}
    pending = [c.id for c in conv.protocol.pending_calls]
    unknown = [i for i in by_id if i not in pending]
    if unknown:
        raise ToolCallConflict(f"unknown or already answered tool calls: {unknown}")
    missing = [i for i in pending if i not in by_id]
    if missing:
        raise InvalidRequest(f"results must answer every pending call; missing {missing}")
    return [Message("tool", conv.protocol.turn, by_id[i], tool_call_id=i) for i in pending]
