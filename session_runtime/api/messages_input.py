"""What a Messages request says beyond its history, read the way the harnesses
that send it mean it (../shared/HARNESSES.md): mid-conversation system
messages, the harness's session key, and the context-management edits that
state which turns keep their thinking.

- **System messages inside `messages`** (Claude Code's reminders) are checked
  against the API's placement rules (never first, right after a user turn,
  last or followed by an assistant turn, never two in a row; a string or text
  blocks) and folded into the user message they follow, as text after its
  own; a user message of tool results takes the text in its last result.
  Never into the leading system prompt: that would change the prefix of every
  later request. Text blocks beside tool results are folded into the last
  result the same way, so tool results stay the step's new input and the
  turn's tool chain goes on.
- **Session key**: the `X-Claude-Code-Session-Id` header, else the
  `session_id` inside `metadata.user_id` when that is JSON.
- **`context_management.edits`**: `clear_thinking_20251015` sets the request's
  reasoning policy (`keep: all` is keep, `thinking_turns` N is keep_last_k N;
  without the edit the server's `--policy`); it needs thinking on.
  `clear_tool_uses_20250919` clears old tool uses from the prompt
  (session_runtime/tool_clearing.py). With both, clear_thinking comes first, as
  Anthropic requires; any other edit is refused with 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from session_runtime.errors import InvalidRequest
from session_runtime.policies import ReasoningPolicy
from session_runtime.tool_clearing import CLEAR_TOOL_USES, Cleared, ToolUseEdit, parse as parse_tool_edit

CLEAR_THINKING = "clear_thinking_20251015"
SESSION_HEADER = "x-claude-code-session-id"


def fold_system_messages(raw: dict) -> dict:
    """The body with its mid-conversation system messages, and text beside
    tool results, folded as the module docstring says. Raises InvalidRequest
    for a system message the API would refuse."""
    messages = raw.get("messages")
    if not isinstance(messages, list):
        return raw  # the adapter refuses it in its own words
    out: list = []
    changed = False
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            text = _system_text(m, i)
            if i == 0 or not _is(messages[i - 1], "user"):
                raise InvalidRequest(f"messages.{i}.role: a system message must follow a user message",
                                     param=f"messages.{i}.role")
            if i + 1 < len(messages) and not _is(messages[i + 1], "assistant"):
                raise InvalidRequest(f"messages.{i}.role: a system message must be the last message or be "
                                     "followed by an assistant message", param=f"messages.{i}.role")
            out[-1] = _with_text(out[-1], text)
            changed = True
        elif _is(m, "user") and isinstance(m.get("content"), list) and _results_and_text(m["content"]):
            out.append(_with_text({**m, "content": [b for b in m["content"] if _block(b) != "text"]},
                                  "".join(b.get("text", "") for b in m["content"] if _block(b) == "text")))
            changed = True
        else:
            out.append(m)
    return {**raw, "messages": out} if changed else raw


def session_key(raw: dict, headers) -> Optional[str]:
    """Claude Code's session id: its header, else `metadata.user_id`'s JSON `session_id`."""
    key = headers.get(SESSION_HEADER)
    if key:
        return key
    user = raw.get("metadata", {}).get("user_id") if isinstance(raw.get("metadata"), dict) else None
    if isinstance(user, str) and user.startswith("{"):
        try:
            value = json.loads(user).get("session_id")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and value else None
    return None


@dataclass(frozen=True)
class ThinkingEdit:
    """What `clear_thinking_20251015` asked: keep every turn's thinking (None) or the last N turns'."""

    keep_turns: Optional[int]

    @property
    def policy(self) -> ReasoningPolicy:
        return ReasoningPolicy("keep") if self.keep_turns is None else ReasoningPolicy("keep_last_k", self.keep_turns)


@dataclass(frozen=True)
class ContextEdits:
    """A request's `context_management.edits`, read."""

    thinking: Optional[ThinkingEdit] = None
    tools: Optional[ToolUseEdit] = None

    @property
    def policy(self) -> Optional[ReasoningPolicy]:
        return self.thinking.policy if self.thinking is not None else None


def context_edits(raw: dict) -> ContextEdits:
    """The request's edits (none without `context_management`). Raises
    InvalidRequest (naming the field) for an edit this server does not apply
    or cannot read, a repeated one, clear_thinking after clear_tool_uses, and
    clear_thinking without thinking on."""
    cm = raw.get("context_management")
    if cm is None:
        return ContextEdits()
    if not isinstance(cm, dict) or not isinstance(cm.get("edits", []), list):
        raise InvalidRequest("context_management: expected an object with a list of edits",
                             param="context_management")
    thinking, tools = None, None
    for j, edit in enumerate(cm.get("edits", [])):
        where = f"context_management.edits.{j}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in (CLEAR_THINKING, CLEAR_TOOL_USES):
            raise InvalidRequest(f"{where}.type: {kind!r} is not supported by this server (only "
                                 f"{CLEAR_THINKING} and {CLEAR_TOOL_USES}); leave the edit out",
                                 param=f"{where}.type")
        if (thinking if kind == CLEAR_THINKING else tools) is not None:
            raise InvalidRequest(f"{where}: a second {kind} edit", param=where)
        if kind == CLEAR_TOOL_USES:
            tools = parse_tool_edit(edit, where)
            continue
        if tools is not None:
            raise InvalidRequest(f"{where}: {CLEAR_THINKING} must come before {CLEAR_TOOL_USES} in the edits",
                                 param=where)
        thinking = ThinkingEdit(_keep(edit.get("keep", {"type": "thinking_turns", "value": 1}), f"{where}.keep"))
    if thinking is not None and not _thinking_on(raw):
        raise InvalidRequest(f"context_management.edits: {CLEAR_THINKING} needs thinking enabled or adaptive",
                             param="context_management.edits")
    return ContextEdits(thinking, tools)


def applied_edits(edits: ContextEdits, cleared_turns: int, cleared_thinking_tokens: int,
                  cleared: Cleared = Cleared(), cleared_tool_tokens: int = 0) -> Optional[dict]:
    """The answer's `context_management`, as Anthropic reports the edits it
    applied (None for a request without edits)."""
    if edits.thinking is None and edits.tools is None:
        return None
    applied = []
    if edits.thinking is not None and cleared_turns:
        applied.append({"type": CLEAR_THINKING, "cleared_thinking_turns": cleared_turns,
                        "cleared_input_tokens": cleared_thinking_tokens})
    if edits.tools is not None and cleared:
        applied.append({"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(cleared.results),
                        "cleared_input_tokens": cleared_tool_tokens})
    return {"applied_edits": applied}


def _keep(keep: object, where: str) -> Optional[int]:
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
        return None
    if isinstance(keep, dict) and keep.get("type") == "thinking_turns":
        value = keep.get("value")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise InvalidRequest(f"{where}.value: expected an integer >= 1", param=f"{where}.value")
    raise InvalidRequest(f"{where}: expected \"all\", {{\"type\": \"all\"}} or {{\"type\": \"thinking_turns\", "
                         "\"value\": N}", param=where)


def _thinking_on(raw: dict) -> bool:
    thinking = raw.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def _system_text(m: dict, i: int) -> str:
    content = m.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_block(b) == "text" and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise InvalidRequest(f"messages.{i}.content: a system message holds a string or text blocks",
                         param=f"messages.{i}.content")


def _with_text(user: dict, text: str) -> dict:
    """`user` with `text` after its own (in its last tool result when it has results)."""
    if not text:
        return user
    content = user.get("content")
    if isinstance(content, str):
        return {**user, "content": f"{content}\n\n{text}" if content else text}
    if not isinstance(content, list):
        return user  # the adapter refuses it
    blocks = list(content)
    last = max((k for k, b in enumerate(blocks) if _block(b) == "tool_result"), default=None)
    if last is None:
        return {**user, "content": blocks + [{"type": "text", "text": "\n\n" + text}]}
    result = dict(blocks[last])
    inner = result.get("content")
    if isinstance(inner, list):
        result["content"] = inner + [{"type": "text", "text": "\n\n" + text}]
    else:
        result["content"] = f"{inner}\n\n{text}" if inner else text
    blocks[last] = result
    return {**user, "content": blocks}


def _results_and_text(blocks: list) -> bool:
    kinds = {_block(b) for b in blocks}
    return "tool_result" in kinds and "text" in kinds


def _block(b: object) -> Optional[str]:
    return b.get("type") if isinstance(b, dict) else None


def _is(m: object, role: str) -> bool:
    return isinstance(m, dict) and m.get("role") == role
