"""Anthropic Messages API conversations as a trace.

Accepted shapes: a request body `{system?, tools?, messages: [...]}` (its other
fields are ignored) or a bare list of messages. The blocks are the ones the
Messages API documents (docs.anthropic.com/en/api/messages, "extended
thinking", "tool use"):

- `system`: a string or a list of text blocks;
- `tools`: `{name, description?, input_schema}`, rendered as OpenAI function
  schemas; a server tool (a `type` other than "custom", no `input_schema`)
  becomes a function with no parameters, with a note;
- assistant content: `thinking` blocks ({thinking, signature}) are the
  reasoning, `text` blocks the reply, `tool_use` blocks ({id, name, input}) the
  calls; `redacted_thinking` (encrypted) and server-tool blocks cannot be
  replayed and are left out, with a note;
- user content: text (and image/document blocks, left out with a note), or
  `tool_result` blocks ({tool_use_id, content, is_error?}). A user message that
  holds tool_result blocks answers the previous assistant's `tool_use` calls
  by `tool_use_id`, in any order; it does not open a turn. Text next to the
  results is appended to the last result (the runtime sends results alone),
  with a note.

Records are named `messages[i]`; fields `content[j]`.
"""

from __future__ import annotations

from session_runtime.replay.builder import Call, TraceBuilder, Where
from session_runtime.replay.formats.common import Dropped, load_json, string, string_id, text_of
from session_runtime.replay.trace import Trace, TraceError

SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                 "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result")


def read(text: str, source: str) -> Trace:
    """Raises TraceError naming the message and field."""
    data = load_json(text)
    system: object = None
    tools: object = []
    if isinstance(data, dict):
        if not isinstance(data.get("messages"), list):
            raise TraceError(0, "expected an object with a list `messages`, or a list of messages")
        system, tools, data = data.get("system"), data.get("tools") or [], data["messages"]
    if not isinstance(data, list):
        raise TraceError(0, f"expected a list of messages, got {type(data).__name__}")
    dropped, notes = Dropped(), []
    builder = TraceBuilder(text_of(Where(0), "system", system, dropped, "\n\n") or None, _tools(notes, tools))
    for note in notes:
        builder.note(None, note)
    for i, m in enumerate(data):
        where = Where(i + 1, f"messages[{i}]", "message")
        if not isinstance(m, dict):
            raise where.error(f"a message must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise where.error(f"{'no role' if role is None else f'unknown role {role!r}'}; expected user or "
                              "assistant (the system prompt is the top-level `system`)", "role")
        if isinstance(content, str):
            blocks: list = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise where.error("must be a string or a list of content blocks", "content")
        for j, b in enumerate(blocks):
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                raise where.error("a content block must be an object with a type", f"content[{j}]")
        if role == "user":
            _user(builder, where, blocks, dropped)
        else:
            _assistant(builder, where, blocks, dropped)
    for note in dropped.notes():
        builder.note(None, note)
    return builder.finish(source, "anthropic")


def _tools(notes: list[str], tools: object) -> list[dict]:
    if not isinstance(tools, list):
        raise TraceError(0, "must be a list of tool definitions", field="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise TraceError(0, "a tool needs a string name", field=f"tools[{i}]")
        schema = t.get("input_schema")
        if schema is None:
            notes.append(f"tools[{i}] ({t.get('type', 'no type')}) is a server tool; it is rendered as a "
                         "function with no parameters")
            schema = {"type": "object", "properties": {}}
        fn = {"name": t["name"], "description": t.get("description") or "", "parameters": schema}
        out.append({"type": "function", "function": fn})
    return out


def _user(builder: TraceBuilder, where: Where, blocks: list, dropped: Dropped) -> None:
    results = [(j, b) for j, b in enumerate(blocks) if b["type"] == "tool_result"]
    texts = [text_of(where, f"content[{j}]", [b], dropped) for j, b in enumerate(blocks) if b["type"] != "tool_result"]
    text = "\n\n".join(t for t in texts if t)
    if not results:
        return builder.user(where, text)
    contents = [text_of(where, f"content[{j}].content", b.get("content"), dropped, "\n\n") for j, b in results]
    if text.strip():
        contents[-1] = f"{contents[-1]}\n\n{text}" if contents[-1] else text
        builder.note(where, "text next to tool results is appended to the last result")
    for (j, b), content in zip(results, contents):
        call_id = b.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise where.error("a tool_result needs a string tool_use_id", f"content[{j}].tool_use_id")
        builder.tool(where, content, call_id, None, f"content[{j}].tool_use_id")


def _assistant(builder: TraceBuilder, where: Where, blocks: list, dropped: Dropped) -> None:
    reasoning, texts, calls = [], [], []
    for j, b in enumerate(blocks):
        kind, field = b["type"], f"content[{j}]"
        if kind == "thinking":
            reasoning.append(string(where, f"{field}.thinking", b.get("thinking")))
        elif kind == "text":
            texts.append(string(where, f"{field}.text", b.get("text")))
        elif kind == "tool_use":
            name, args = b.get("name"), b.get("input", {})
            if not isinstance(name, str) or not name:
                raise where.error("a tool_use needs a non-empty string name", f"{field}.name")
            if not isinstance(args, dict):
                raise where.error("must be an object", f"{field}.input")
            calls.append(Call(name, args, string_id(b.get("id"))))
        else:  # redacted_thinking, server tools, anything newer
            dropped.add(where, kind)
    builder.assistant(where, "\n\n".join(r for r in reasoning if r), "\n\n".join(t for t in texts if t), calls)
