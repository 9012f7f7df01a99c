"""What a Messages request's context edits (api/messages_input.py
`context_edits`) do to its prompt, worked out before its step runs: the
thinking turns clear_thinking drops, the tool uses clear_tool_uses clears
(session_runtime/tool_clearing.py), the tokens each frees, and the `rules`
the step's accounting keeps. Counting renders the request's prompt as its
step would (api/token_count.py); a request without clear_tool_uses costs no
rendering here, one with it one or two (before the edit, where its trigger
is on input tokens, and after it, when it clears anything).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from session_runtime.api.messages_input import CLEAR_THINKING, ContextEdits, applied_edits
from session_runtime.api.token_count import prompt_tokens
from session_runtime.policies import ReasoningPolicy
from session_runtime.tool_clearing import CLEAR_TOOL_USES, NOTHING, Cleared, decide, tool_uses


@dataclass(frozen=True)
class Applied:
    """The edits' effect on one request."""

    policy: Optional[ReasoningPolicy]  # clear_thinking's, else None (the conversation's)
    cleared: Cleared  # the tool uses the prompt shows cleared (none without clear_tool_uses)
    report: Optional[dict]  # the answer's `context_management` (None: the request had no edits)
    rules: Optional[dict]  # the step's accounting `rules` (None: no edit decided anything)
    input_tokens: Optional[int] = None  # the prompt after the edits, where counting it was needed here


def apply_edits(runtime, messages: list[dict], tools, tenant, edits: ContextEdits) -> Applied:
    """The edits' effect on the chat request (`messages`, `tools`) of
    `tenant`. Raises what counting its prompt raises (api/token_count.py)."""
    turns, thinking_tokens = cleared_thinking(runtime, messages, edits)
    cleared, tool_tokens, after = NOTHING, 0, None
    if edits.tools is not None:
        new = frozenset(str(m.get("tool_call_id")) for m in _trailing_results(messages))
        before = prompt_tokens(runtime, messages, tools, tenant, edits.policy) \
            if edits.tools.needs_input_tokens else None
        cleared = decide(edits.tools, tool_uses(messages), new, before, runtime.tokenizer.count)
        if cleared:
            if before is None:
                before = prompt_tokens(runtime, messages, tools, tenant, edits.policy)
            after = prompt_tokens(runtime, messages, tools, tenant, edits.policy, cleared)
            tool_tokens = before - after
        else:
            after = before
    rules = {}
    if edits.thinking is not None:
        p = edits.policy
        rules["reasoning"] = {"rule": CLEAR_THINKING, "policy": p.name, "keep_last_k": p.keep_last_k}
    if edits.tools is not None:
        rules["tool_uses"] = {"rule": CLEAR_TOOL_USES, "cleared": len(cleared.results),
                              "cleared_inputs": len(cleared.inputs)}
    return Applied(edits.policy, cleared, applied_edits(edits, turns, thinking_tokens, cleared, tool_tokens),
                   rules or None, after)


def cleared_thinking(runtime, messages: list[dict], edits: ContextEdits) -> tuple[int, int]:
    """(turns, tokens) of thinking the clear_thinking edit clears from this
    request's prompt: the closed turns older than the last `keep_turns` whose
    assistant messages carry reasoning, and that reasoning's tokens."""
    edit = edits.thinking
    if edit is None or edit.keep_turns is None:
        return 0, 0
    turns: list[list[str]] = []
    for m in messages:
        if m.get("role") == "user":
            turns.append([])
        elif m.get("role") == "assistant" and turns and m.get("reasoning_content"):
            turns[-1].append(m["reasoning_content"])
    # The last turn is the one this request opens (a user message) or continues (tool results): never cleared.
    closed = turns[:-1]
    cleared = [t for t in closed[: max(len(closed) - edit.keep_turns, 0)] if t]
    return len(cleared), sum(runtime.tokenizer.count(text) for t in cleared for text in t)


def original_tokens(runtime, messages: list[dict], tools, tenant) -> int:
    """count_tokens' `original_input_tokens`: the prompt before any edit (every thinking block, every result)."""
    return prompt_tokens(runtime, messages, tools, tenant, ReasoningPolicy("keep"))


def _trailing_results(messages: list[dict]) -> list[dict]:
    i = len(messages)
    while i > 0 and isinstance(messages[i - 1], dict) and messages[i - 1].get("role") == "tool":
        i -= 1
    return messages[i:]
