"""A template's messages as its chat template takes them (OpenAI's dicts:
`reasoning_content` or `thinking`, `tool_calls`, `tool_call_id`), each with its
bytes for a digest, and the tools in OpenAI's shape. Both kept per object: a
step renders the same history several times (templates/hf.py)."""

from __future__ import annotations

from typing import Optional, Sequence

from session_runtime.bounded_cache import IdentityMemo
from session_runtime.templates.base import Message
from session_runtime.templates.official import blob

_MESSAGE_DICTS = 64 << 20  # bytes of the messages whose template dicts are kept (the messages kept alive)


def _openai_tool(tool: dict) -> dict:
    return tool if isinstance(tool, dict) and "function" in tool else {"type": "function", "function": tool}


class TemplateMessages:
    """`thinking_field`: where the chat template reads an assistant's reasoning."""

    def __init__(self, thinking_field: str):
        self.thinking_field = thinking_field
        # message -> (its dict, its blob), within _MESSAGE_DICTS bytes of blobs
        self._dicts: IdentityMemo[tuple[dict, bytes]] = IdentityMemo(
            _MESSAGE_DICTS, lambda m, hit: 2 * len(hit[1]) + 8 * len(m.output_ids) + 300)
        # tools -> the same in OpenAI's shape (one list per tools object: official._tools_bytes keeps its digest)
        self._tools: IdentityMemo[list[dict]] = IdentityMemo(16 << 20, lambda tools, out: 1000 * len(out) + 100)

    def dicts(self, system: Optional[str], messages: Sequence[Message]) -> list[dict]:
        out = [{"role": "system", "content": system}] if system is not None else []
        return out + [self.one(m)[0] for m in messages]

    def one(self, m: Message) -> tuple[dict, bytes]:
        """A message as the template takes it, and its bytes in a digest (kept
        per message object: a step renders the same history several times)."""
        return self._dicts.get(m, self._build)

    def _build(self, m: Message) -> tuple[dict, bytes]:
        if m.role == "assistant":
            d = {"role": "assistant", "content": m.content}
            if m.reasoning:
                d[self.thinking_field] = m.reasoning
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        elif m.role == "tool":
            d = {"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content}
        else:
            d = {"role": "user", "content": m.content}
        return d, blob(d)

    def tools(self, tools: Sequence[dict]) -> list[dict]:
        """The tools in OpenAI's shape, one list per tools object (so that its
        digest is kept: official._tools_bytes)."""
        return self._tools.get(tools, lambda ts: [_openai_tool(t) for t in ts])

    def blobs(self, dicts: list[dict], offset: int, messages: Sequence[Message]) -> list[bytes]:
        return [blob(d) for d in dicts[:offset]] + [self.one(m)[1] for m in messages]
