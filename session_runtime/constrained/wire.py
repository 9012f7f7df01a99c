"""Each protocol's constraint fields read into one `OutputConstraint`, checked
as the provider checks them: a forced or required tool call, a JSON schema or
JSON object for the answer, stop sequences. Bad input is an InvalidRequest
naming the field in the protocol's own words; nothing here reads a
conversation (a tool name is checked against the conversation's tools when
the step's grammar is built, constrained/grammar.py).

| | forced call | answer schema | stop |
|---|---|---|---|
| Chat Completions (and the session API) | `tool_choice` required / a function | `response_format` | `stop`, 4 |
| Responses | `tool_choice` required / a function / allowed_tools required | `text.format` | none |
| Messages | `tool_choice` any / tool | `output_format`, `output_config.format` | `stop_sequences`, 16 |
| Gemini | `toolConfig.functionCallingConfig` ANY (`allowedFunctionNames`) | `generationConfig.responseJsonSchema` / `responseSchema` | `generationConfig.stopSequences`, 5 |

Reasoning effort (`reasoning_effort`, Responses' `reasoning.effort`,
Messages' `output_config.effort`) and Messages' `thinking` (disabled: 0,
enabled: its budget_tokens) and Gemini's `thinkingConfig` (`thinkingBudget`,
0: off, -1: the model's own; `thinkingLevel`) bound the reasoning block (spec.EFFORT_SHARE):
none and minimal close it at once (thinking off), low gives it a quarter of
the output cap, the others leave the model's own.

OpenAI's `none` (and Gemini's NONE) with tools keeps the tools in the prompt (the cached prefix
stays the conversation's) and the answer from starting a call; Messages'
`none` leaves the tools out of the prompt, as before. With an answer schema
and tools the step may call a tool or answer in the schema, as OpenAI's
structured outputs do. `parallel_tool_calls: false` (`disable_parallel_tool_use`)
needs nothing more where a call is forced: the grammar admits one call.
"""

from __future__ import annotations

import json
from typing import Optional

from session_runtime.constrained.spec import NONE, OutputConstraint, stop_sequences
from session_runtime.errors import InvalidRequest

OPENAI_STOPS = 4  # OpenAI's documented limit
ANTHROPIC_STOPS = 16  # Anthropic documents none; this server's, said in docs/api.md
OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ANTHROPIC_EFFORTS = ("low", "medium", "high", "max")
GEMINI_STOPS = 5  # Gemini's documented limit
GEMINI_LEVELS = ("minimal", "low", "medium", "high")
_GEMINI_MODES = ("AUTO", "ANY", "NONE", "VALIDATED")
_JSON_OBJECT = json.dumps({"type": "object"})


def chat(tool_choice: object, response_format: object, stop: object, effort: object = None) -> OutputConstraint:
    """Chat Completions' fields (the session API takes the same)."""
    call, tools = _openai_choice(tool_choice, nested=True)
    schema = _openai_format(response_format, "response_format", nested=True)
    return _constraint(call, tools, schema, stop_sequences(stop, "stop", OPENAI_STOPS), "response_format",
                       effort=_effort(effort, "reasoning_effort", OPENAI_EFFORTS))


def responses(tool_choice: object, text_format: object, effort: object = None) -> OutputConstraint:
    """Responses' fields (it has no stop sequences)."""
    call, tools = _openai_choice(tool_choice, nested=False)
    schema = _openai_format(text_format, "text.format", nested=False)
    return _constraint(call, tools, schema, (), "text.format",
                       effort=_effort(effort, "reasoning.effort", OPENAI_EFFORTS))


def messages(raw: dict) -> OutputConstraint:
    """Messages' fields, from the body: `tool_choice` any or tool, the answer's
    `output_format` (or `output_config.format`), `stop_sequences`."""
    choice = raw.get("tool_choice")
    call, tools = None, ()  # none: the route leaves the tools out of the prompt (api/messages_route.py)
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        call = True
        if choice["type"] == "tool":
            tools = (_name(choice.get("name"), "tool_choice.name"),)
    field, fmt = "output_format", raw.get("output_format")
    config = raw.get("output_config")
    if fmt is None and isinstance(config, dict) and config.get("format") is not None:
        field, fmt = "output_config.format", config["format"]
    schema = None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(f"{field}: expected {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=field)
        schema = json.dumps(fmt["schema"], ensure_ascii=False)
    stop = stop_sequences(raw.get("stop_sequences"), "stop_sequences", ANTHROPIC_STOPS)
    effort = _effort(config.get("effort") if isinstance(config, dict) else None, "output_config.effort",
                     ANTHROPIC_EFFORTS)
    return _constraint(call, tools, schema, stop, field, _thinking_budget(raw.get("thinking")), effort)


def gemini(raw: dict) -> OutputConstraint:
    """Gemini's fields: `toolConfig.functionCallingConfig` (mode AUTO, ANY with
    `allowedFunctionNames`, NONE), `generationConfig` (`responseMimeType`
    application/json with `responseJsonSchema` or `responseSchema`,
    `stopSequences`, `thinkingConfig`)."""
    from session_runtime.protocols.convert import gemini_schema

    config = raw.get("toolConfig")
    calling = config.get("functionCallingConfig") if isinstance(config, dict) else None
    call, tools = None, ()
    if calling is not None:
        field = "toolConfig.functionCallingConfig"
        mode = calling.get("mode", "AUTO") if isinstance(calling, dict) else None
        if mode not in _GEMINI_MODES:
            raise InvalidRequest(f"{field}.mode: expected one of {', '.join(_GEMINI_MODES)}", param=f"{field}.mode")
        allowed = calling.get("allowedFunctionNames")
        if allowed is not None and (mode != "ANY" or not isinstance(allowed, list) or not allowed):
            raise InvalidRequest(f"{field}.allowedFunctionNames: a list of function names, with mode ANY",
                                 param=f"{field}.allowedFunctionNames")
        call = {"ANY": True, "NONE": False}.get(mode)
        tools = tuple(_name(n, f"{field}.allowedFunctionNames") for n in allowed or ())
    gen = raw.get("generationConfig")
    gen = gen if isinstance(gen, dict) else {}
    schema = None
    mime = gen.get("responseMimeType")
    if mime not in (None, "text/plain", "application/json"):
        raise InvalidRequest("generationConfig.responseMimeType: expected text/plain or application/json",
                             param="generationConfig.responseMimeType")
    for field in ("responseJsonSchema", "responseSchema"):
        value = gen.get(field)
        if value is not None:
            if not isinstance(value, dict) or mime != "application/json":
                raise InvalidRequest(f"generationConfig.{field}: a schema object, with responseMimeType "
                                     "application/json", param=f"generationConfig.{field}")
            schema = json.dumps(value if field == "responseJsonSchema" else gemini_schema(value), ensure_ascii=False)
            break
    if schema is None and mime == "application/json":
        schema = _JSON_OBJECT
    stop = stop_sequences(gen.get("stopSequences"), "generationConfig.stopSequences", GEMINI_STOPS)
    budget, level = _gemini_thinking(gen.get("thinkingConfig"))
    return _constraint(call, tools, schema, stop, "generationConfig.responseJsonSchema", budget, level)


def _gemini_thinking(thinking: object) -> tuple[Optional[int], Optional[str]]:
    """(the reasoning's budget, the effort) of Gemini's thinkingConfig:
    thinkingBudget 0 is off, -1 the model's own; thinkingLevel an effort."""
    if thinking is None:
        return None, None
    field = "generationConfig.thinkingConfig"
    if not isinstance(thinking, dict):
        raise InvalidRequest(f"{field}: expected an object", param=field)
    budget = thinking.get("thinkingBudget")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < -1):
        raise InvalidRequest(f"{field}.thinkingBudget: expected a number of tokens, or -1",
                             param=f"{field}.thinkingBudget")
    level = thinking.get("thinkingLevel")
    if isinstance(level, str):
        level = level.lower()
    if level is not None and level not in GEMINI_LEVELS:
        raise InvalidRequest(f"{field}.thinkingLevel: expected one of {', '.join(GEMINI_LEVELS)}",
                             param=f"{field}.thinkingLevel")
    return (None if budget in (None, -1) else budget), level


def _constraint(call: Optional[bool], tools: tuple, schema: Optional[str], stop: tuple, schema_field: str,
                think_budget: Optional[int] = None, effort: Optional[str] = None) -> OutputConstraint:
    if call:
        schema = None  # a forced call is the step's whole output: there is no answer for a schema to shape
    if call is None and schema is None and not stop and think_budget is None and effort is None:
        return NONE
    return OutputConstraint(call=bool(call), no_call=call is False, tools=tools, answer_schema=schema, stop=stop,
                            schema_field=schema_field, think_budget=think_budget, effort=effort)


def _effort(value: object, field: str, known: tuple[str, ...]) -> Optional[str]:
    """The protocol's reasoning effort, checked (EFFORT_SHARE says which bound the reasoning)."""
    if value is None:
        return None
    if value not in known:
        raise InvalidRequest(f"{field}: expected one of {', '.join(known)}", param=field)
    return value


def _thinking_budget(thinking: object) -> Optional[int]:
    """Anthropic's `thinking` as a reasoning budget: disabled is 0 (the
    reasoning block closed at once), enabled its budget_tokens; adaptive and
    none given leave the model's own."""
    if not isinstance(thinking, dict):
        return None
    if thinking.get("type") == "disabled":
        return 0
    budget = thinking.get("budget_tokens")
    if thinking.get("type") == "enabled" and isinstance(budget, int) and not isinstance(budget, bool):
        if budget < 0:
            raise InvalidRequest("thinking.budget_tokens: expected a number of tokens", param="thinking.budget_tokens")
        return budget
    return None


def _openai_choice(choice: object, nested: bool) -> tuple[Optional[bool], tuple[str, ...]]:
    """(a call is forced: True, forbidden: False, else None; the tools it may
    name) for OpenAI's `tool_choice`: auto, none, required, a function (Chat
    nests its name under `function`), or allowed_tools in mode required."""
    if choice is None or choice == "auto":
        return None, ()
    if choice == "none":
        return False, ()
    if choice == "required":
        return True, ()
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return True, (_tool_name(choice, nested, "tool_choice.function.name" if nested else "tool_choice.name"),)
    if kind == "allowed_tools":
        allowed = choice.get("allowed_tools") if nested else choice
        allowed = allowed if isinstance(allowed, dict) else {}
        if allowed.get("mode") == "required" and isinstance(allowed.get("tools"), list) and allowed["tools"]:
            return True, tuple(_tool_name(t, nested, "tool_choice.tools") for t in allowed["tools"])
        raise InvalidRequest("tool_choice: allowed_tools is supported in mode \"required\" with a list of "
                             "function tools; leave it out for auto", param="tool_choice")
    raise InvalidRequest(f"tool_choice {json.dumps(choice)} is not supported: expected \"auto\", \"none\", "
                         "\"required\" or a function tool", param="tool_choice")


def _openai_format(fmt: object, field: str, nested: bool) -> Optional[str]:
    """The answer's schema (JSON text) for OpenAI's response_format /
    text.format: text (None), json_object, or json_schema (Chat nests it under
    `json_schema`), a strict schema checked as OpenAI checks one."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _JSON_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema") if nested else fmt
        where = f"{field}.json_schema" if nested else field
        if not isinstance(spec, dict):
            raise InvalidRequest(f"{where}: expected an object with name and schema", param=where)
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where}.schema: expected a JSON schema object", param=f"{where}.schema")
        if spec.get("strict"):
            strict_check(schema, spec.get("name", ""), field)
        return json.dumps(schema, ensure_ascii=False)
    raise InvalidRequest(f"{field}: type must be one of text, json_object, json_schema", param=field)


def strict_check(schema: dict, name: str, field: str) -> None:
    """OpenAI's rules for a strict schema: an object at the root, and in every
    object `additionalProperties: false` and every property required. Raises
    InvalidRequest in OpenAI's words."""
    def refuse(where: str, why: str) -> None:
        raise InvalidRequest(f"Invalid schema for {field} '{name}': In context={where}, {why}", param=field)

    if schema.get("type") != "object":
        refuse("()", "schema must be a JSON Schema of 'type: \"object\"'")

    def walk(node: object, where: tuple) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, where + (str(i),))
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "object" or "properties" in node:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            if node.get("additionalProperties") is not False:
                refuse(str(where), "'additionalProperties' is required to be supplied and to be false")
            missing = [p for p in props if p not in required]
            if missing:
                refuse(str(where), f"'required' is required to be supplied and to be an array including every "
                                   f"key in properties. Missing '{missing[0]}'")
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                for sub, child in value.items():
                    walk(child, where + (key, sub))
            elif key in ("items", "anyOf", "allOf", "oneOf", "prefixItems"):
                walk(value, where + (key,))

    walk(schema, ())


def _tool_name(tool: object, nested: bool, field: str) -> str:
    """A function tool's name in OpenAI's writing (Chat nests it under `function`)."""
    inner = tool.get("function") if nested and isinstance(tool, dict) else tool
    return _name(inner.get("name") if isinstance(inner, dict) else None, field)


def _name(value: object, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field}: expected a tool's name", param=field)
    return value
