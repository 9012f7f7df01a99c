"""One protocol's canonical request as a Chat Completions history (DeepSeek's
or an OpenAI-compatible server's), so a caller can render the same history in
that form.

What crosses over: roles, text, images, reasoning text, tool calls and their
results, function tools, and the model and sampling figures (`model`,
`max_tokens`, `temperature`, `top_p`). Continuation state does not (a
signature or an encrypted item means nothing to another provider), nor do
blocks and tools with no chat equivalent (server tools, documents); other
parameters are the caller's to set.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from session_runtime.protocols.base import CHAT_PROTOCOLS
from session_runtime.protocols.canonical import Call, ChatRequest, Msg, Reasoning, reasoning_text

_CARRIED = ("model", "max_tokens", "temperature", "top_p")
_GEMINI_CARRIED = {"maxOutputTokens": "max_tokens", "temperature": "temperature", "topP": "top_p"}


def to_chat(req: ChatRequest, source: str, target: str = "deepseek") -> ChatRequest:
    """`req`, parsed by protocol `source`, as a `target` chat request (deepseek
    or openai-chat). Raises ValueError for other names. Chat to chat keeps
    every field (DeepSeek's reasoning is `reasoning_content`, its system role
    stands in for `developer`); from Anthropic and Responses the history is
    rebuilt from the fields listed in the module docstring."""
    if target not in CHAT_PROTOCOLS:
        raise ValueError(f"cannot convert to {target!r}; only to {' or '.join(CHAT_PROTOCOLS)}")
    if source in CHAT_PROTOCOLS:
        return req if target == "openai-chat" else dataclasses.replace(
            req, messages=tuple(_deepseek_message(m) for m in req.messages))
    if source == "anthropic":
        messages, tools = _from_anthropic(req), [_tool(t.get("name"), t.get("description"), t.get("input_schema"))
                                                 for t in req.tools if isinstance(t, dict) and "input_schema" in t]
        params = {k: req.params[k] for k in _CARRIED if k in req.params}
    elif source == "gemini":
        messages, tools = _from_gemini(req), [_tool(d.get("name"), d.get("description"), gemini_parameters(d))
                                              for t in req.tools if isinstance(t, dict)
                                              for d in t.get("functionDeclarations") or () if isinstance(d, dict)]
        config = req.params.get("generationConfig")
        config = config if isinstance(config, dict) else {}
        params = {chat: config[key] for key, chat in _GEMINI_CARRIED.items() if key in config}
    elif source == "openai-responses":
        messages, tools = _from_responses(req), [_tool(t.get("name"), t.get("description"), t.get("parameters"))
                                                 for t in req.tools if isinstance(t, dict) and t.get("type") == "function"]
        params = {k: req.params[k] for k in _CARRIED if k in req.params}
        if "max_output_tokens" in req.params:
            params["max_tokens"] = req.params["max_output_tokens"]
    else:
        raise ValueError(f"unknown protocol {source!r}")
    if target == "deepseek":
        messages = [_deepseek_message(m) for m in messages]
    return ChatRequest(tuple(messages), tuple(tools), params)


def _deepseek_message(m: Msg) -> Msg:
    """A chat message in DeepSeek's names: `reasoning` becomes `reasoning_content`."""
    layout = tuple(dict.fromkeys("reasoning_content" if k == "reasoning" else k for k in m.layout))
    extra = {k: v for k, v in m.extra.items() if k != "reasoning"}
    role = "system" if m.role == "developer" else m.role
    if (layout, extra, role) == (m.layout, m.extra, m.role):
        return m
    return dataclasses.replace(m, role=role, layout=layout, extra=extra)


def _tool(name: Any, description: Any, parameters: Any) -> dict:
    function: dict = {"name": name}
    if isinstance(description, str):
        function["description"] = description
    function["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object"}
    return {"type": "function", "function": function}


def _assistant(m: Msg, content: Optional[str]) -> Msg:
    reasoning = None if m.reasoning is None else (Reasoning(reasoning_text(m)),)
    return Msg("assistant", content, reasoning, tuple(Call(c.id, c.name, c.arguments) for c in m.calls))


def _parts(content: Any) -> Any:
    """Content parts of another protocol as chat content: one string when
    all of it is text, else chat parts (text and images)."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for p in content if isinstance(content, list) else ():
        if not isinstance(p, dict):
            continue
        kind = p.get("type")
        if kind in ("text", "input_text", "output_text") and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image" and isinstance(p.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        elif kind == "image" and isinstance(p.get("source"), dict):
            source = p["source"]
            url = source.get("url") if source.get("type") == "url" else (
                f"data:{source.get('media_type')};base64,{source.get('data')}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _text(content: Any) -> Optional[str]:
    value = _parts(content)
    return value if isinstance(value, str) or value is None else "".join(
        p["text"] for p in value if p["type"] == "text")


def _from_anthropic(req: ChatRequest) -> list[Msg]:
    system = req.params.get("system")
    out = [Msg("system", _text(system))] if system else []
    for m in req.messages:
        if m.role == "assistant":
            out.append(_assistant(m, _text(m.content) or None))
            continue
        blocks = m.content if isinstance(m.content, list) else [{"type": "text", "text": m.content}]
        for b in blocks:  # results first: they answer the assistant message just before
            if isinstance(b, dict) and b.get("type") == "tool_result":
                out.append(Msg("tool", _text(b.get("content")) or "", call_id=b.get("tool_use_id")))
        rest = [b for b in blocks if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        if rest:
            out.append(Msg("user", _parts(rest)))
    return out


def _from_gemini(req: ChatRequest) -> list[Msg]:
    """Gemini's turns as chat messages: thought parts are the reasoning, a
    functionResponse part a tool message (answering the call of its id, or
    else the earliest unanswered call of its name), the text parts of a turn
    one text (adjacent parts joined as Gemini reads them)."""
    system = req.params.get("systemInstruction")
    text = _gemini_text(system.get("parts") if isinstance(system, dict) else [{"text": system}])
    out = [Msg("system", text)] if text else []
    open_calls: list[Call] = []
    for i, m in enumerate(req.messages):
        if m.role == "assistant":
            calls = tuple(Call(c.id or f"call_{i}_{k}", c.name, c.arguments) for k, c in enumerate(m.calls))
            open_calls = list(calls)
            out.append(_assistant(dataclasses.replace(m, calls=calls), _gemini_text(m.content) or None))
            continue
        parts = m.content if isinstance(m.content, list) else []
        for p in parts:
            response = p.get("functionResponse") if isinstance(p, dict) else None
            if isinstance(response, dict):
                call = _answered(open_calls, response)
                out.append(Msg("tool", json.dumps(response.get("response"), ensure_ascii=False),
                               call_id=call.id if call is not None else response.get("id") or response.get("name")))
        rest = [p for p in parts if not (isinstance(p, dict) and "functionResponse" in p)]
        if rest:
            out.append(Msg("user", _parts([_gemini_part(p) for p in rest])))
    return out


def _answered(open_calls: list[Call], response: dict) -> Optional[Call]:
    """The call a functionResponse answers (taken off `open_calls`): its id's, else its name's first."""
    rid, name = response.get("id"), response.get("name")
    for k, c in enumerate(open_calls):
        if (c.id == rid) if rid else (c.name == name):
            return open_calls.pop(k)
    return None


def _gemini_part(p: Any) -> Any:
    """A Gemini part in the other protocols' block shape (text, or an inline image)."""
    if not isinstance(p, dict):
        return p
    if isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    data = p.get("inlineData")
    if isinstance(data, dict) and str(data.get("mimeType", "")).startswith("image/"):
        return {"type": "image", "source": {"type": "base64", "media_type": data["mimeType"], "data": data.get("data")}}
    return p


def _gemini_text(parts: Any) -> str:
    return "".join(p["text"] for p in parts or () if isinstance(p, dict) and isinstance(p.get("text"), str)
                   and p.get("thought") is not True)


def gemini_parameters(declaration: dict) -> dict:
    """A functionDeclaration's parameters as a JSON schema: `parametersJsonSchema`
    as it is, or Gemini's OpenAPI `parameters` with its upper-case types in JSON
    schema's (and `nullable` as a null type)."""
    if isinstance(declaration.get("parametersJsonSchema"), dict):
        return declaration["parametersJsonSchema"]
    return gemini_schema(declaration.get("parameters")) if isinstance(declaration.get("parameters"), dict) else {
        "type": "object", "properties": {}}


def gemini_schema(schema: Any) -> Any:
    """Gemini's OpenAPI schema as a JSON schema (types in lower case, `nullable` a null type)."""
    if isinstance(schema, list):
        return [gemini_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            out[k] = v.lower()
        elif k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: gemini_schema(s) for name, s in v.items()}
        elif k in ("items", "anyOf", "oneOf", "allOf", "additionalProperties", "not", "prefixItems"):
            out[k] = gemini_schema(v)
        elif k == "propertyOrdering" or (k == "nullable" and v is False):
            continue
        else:
            out[k] = v
    if out.pop("nullable", False) is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _from_responses(req: ChatRequest) -> list[Msg]:
    instructions = req.params.get("instructions")
    out = [Msg("system", instructions)] if isinstance(instructions, str) and instructions else []
    for m in req.messages:
        if m.role == "assistant":
            if m.reasoning is None and not m.calls and m.content is None:
                continue  # a turn of other items only (item references, server tool calls)
            out.append(_assistant(m, _text(m.content) if m.content is not None else None))
        elif m.role == "tool":
            out.append(Msg("tool", _text(m.content) or "", call_id=m.call_id))
        else:
            out.append(Msg(m.role, _parts(m.content)))
    return out
