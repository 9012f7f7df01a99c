"""A conversation's tools, checked once when it is created (or when a client
replaces its history): OpenAI's function-tool schema, with the count and size
bounded, so one tenant cannot make the server hold megabytes of tool
definitions that no context could take.
"""

from __future__ import annotations

import json
import re

from session_runtime.errors import InvalidRequest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def check_tools(tools: object, max_count: int, max_bytes: int) -> tuple[list[dict], str]:
    """The tools as a list, each `{"type": "function", "function": {name,
    description?, parameters?, strict?}}` or the bare function object, and
    their JSON text (what a template may render of them, for the length check
    that runs before anything is tokenized). Raises
    InvalidRequest (param `tools`) for another shape, more than `max_count`
    tools or more than `max_bytes` of JSON (0: no limit), before looking at
    each one."""
    if tools is None:
        return [], "[]"
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequest("tools must be a list of objects", param="tools")
    if max_count and len(tools) > max_count:
        raise InvalidRequest(f"{len(tools)} tools are more than this server takes for one conversation "
                             f"({max_count}, --max-tools)", param="tools")
    try:
        text = json.dumps(list(tools), ensure_ascii=False)
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError):
        raise InvalidRequest("tools must be JSON objects of valid Unicode text", param="tools") from None
    if max_bytes and size > max_bytes:
        raise InvalidRequest(f"tools of {size} bytes are more than this server takes for one conversation "
                             f"({max_bytes}, --max-tools-bytes)", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise InvalidRequest(f"tools[{i}]: a second function named {name!r}", param="tools")
        names.add(name)
    return list(tools), text


def _check_tool(tool: object, where: str) -> str:
    """The function's name. Raises InvalidRequest."""
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{where} must be an object", param="tools")
    fn = tool
    if "function" in tool or "type" in tool:
        if tool.get("type") != "function":
            raise InvalidRequest(f"{where}.type must be 'function', got {tool.get('type')!r}", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(f"{where}.function must be an object", param="tools")
        where += ".function"
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                             param="tools")
    for key, kinds, what in (("description", (str,), "a string"), ("parameters", (dict,), "a JSON schema object"),
                             ("strict", (bool,), "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kinds):
            raise InvalidRequest(f"{where}.{key} must be {what}", param="tools")
    return name
