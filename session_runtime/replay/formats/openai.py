"""OpenAI chat messages as a trace.

Accepted shapes: a JSON array of messages; a JSON object with `messages` and
optional `tools` (a request body; its other fields are ignored); or JSONL, one
message a line. Messages are Chat Completions messages as the API documents them
(platform.openai.com/docs/api-reference/chat/create) and as the SDK dumps them:
fields the replay does not need (`refusal` when null, `annotations`, `audio`,
`function_call: null`, `name`, ...) are ignored; `content` may be a string, null
or a list of parts of which the text parts count.

- `system` and `developer` messages before the first user message form the
  system prompt (joined by blank lines);
- assistant reasoning is `reasoning_content` (DeepSeek, vLLM, SGLang) or
  `reasoning` (OpenRouter, Ollama); a non-null `refusal` with no content is the
  reply's text;
- `tool` messages answer the calls of the assistant message before them by
  `tool_call_id`, in any order; the legacy `function_call` / `function` pair
  is read too (matched by position).

Records are named `messages[i]` (JSON) or `line N` (JSONL).
"""

from __future__ import annotations

import json

from session_runtime.replay.builder import Call, TraceBuilder, Where
from session_runtime.replay.formats.common import Dropped, json_arguments, string, string_id, text_of, tool_call
from session_runtime.replay.trace import Trace, TraceError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def read(text: str, source: str) -> Trace:
    """Raises TraceError naming the message (or line) and field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is None or isinstance(data, (str, int, float)):
        return _read_jsonl(text, source)
    tools: object = []
    if isinstance(data, dict):
        if "role" in data:  # a one-line JSONL file
            return _read_jsonl(text, source)
        if not isinstance(data.get("messages"), list):
            raise TraceError(0, "expected a list of messages or an object with a list `messages`")
        data, tools = data["messages"], data.get("tools") or []
    if not isinstance(data, list):
        raise TraceError(0, f"expected a list of messages, got {type(data).__name__}")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TraceError(0, "tools must be a list of objects (function schemas)", field="tools")
    reader = _Reader(tools)
    for i, message in enumerate(data):
        reader.feed(Where(i + 1, f"messages[{i}]", "message"), message)
    return reader.finish(source)


def _read_jsonl(text: str, source: str) -> Trace:
    reader = _Reader([])
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            message = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(number, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
        reader.feed(Where(number), message)
    return reader.finish(source)


class _Reader:
    def __init__(self, tools: list[dict]) -> None:
        self.builder = TraceBuilder(None, tools)
        self.dropped = Dropped()

    def finish(self, source: str) -> Trace:
        for note in self.dropped.notes():
            self.builder.note(None, note)
        return self.builder.finish(source, "openai")

    def feed(self, where: Where, m: object) -> None:
        if not isinstance(m, dict):
            raise where.error(f"a message must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise where.error(f"{'no role' if role is None else f'unknown role {role!r}'}; "
                              f"expected one of {', '.join(ROLES)}", "role")
        content = text_of(where, "content", m.get("content"), self.dropped)
        if role in ("system", "developer"):
            self.builder.system(where, content)
        elif role == "user":
            self.builder.user(where, content)
        elif role == "assistant":
            self._assistant(where, m, content)
        else:
            call_id = string_id(m.get("tool_call_id")) if role == "tool" else None
            name = m.get("name") if role == "function" else None
            self.builder.tool(where, content, call_id, name, "tool_call_id")

    def _assistant(self, where: Where, m: dict, content: str) -> None:
        reasoning = string(where, "reasoning_content", m.get("reasoning_content"))
        other = m.get("reasoning")
        if isinstance(other, str) or other is None:
            other = other or ""
            if reasoning and other and other != reasoning:
                raise where.error("reasoning_content and reasoning differ; give one", "reasoning")
            reasoning = reasoning or other
        # else: a structured reasoning object (not text the model wrote): ignored
        if not content:
            content = string(where, "refusal", m.get("refusal"))
        raw_calls = m.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise where.error("must be a list", "tool_calls")
        calls = [tool_call(where, f"tool_calls[{i}]", c) for i, c in enumerate(raw_calls)]
        legacy = m.get("function_call")
        if legacy is not None:
            if not isinstance(legacy, dict) or not isinstance(legacy.get("name"), str):
                raise where.error("must be null or {name, arguments}", "function_call")
            calls.append(Call(legacy["name"], json_arguments(where, "function_call.arguments",
                                                             legacy.get("arguments"))))
        self.builder.assistant(where, reasoning, content, calls)
