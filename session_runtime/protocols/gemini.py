"""Google Gemini (`generateContent`): `contents` of `user` and `model`
turns made of parts, a top-level `systemInstruction` and `tools` of
`functionDeclarations` (both kept in params and tools as the wire had them),
and thought signatures: a `thoughtSignature` sibling on the part it belongs
to, which must come back on that same part.

A model turn's parts are split into reasoning (`thought: true` parts, each
part verbatim in `opaque`), calls (`functionCall` parts, the part in
`opaque`, so its signature goes back with it) and content (every other part,
verbatim); `layout` records their order, and whether the turn had a `role`
at all (a single-turn request may leave it out). User turns stay as they
are: `convert.to_chat` splits their `functionResponse` parts for another
protocol.

The adapter reads and writes field names as Google writes them
(lowerCamelCase); the inbound route first reads the other form too
(`camel_keys`), as Google's parser does.

Outbound (`strip`): the current turn (from the last user turn that is not
only function responses) goes whole; earlier model turns lose their thought
parts (`context: all_turns` keeps them), and every signature stays on its
part. `validate` applies Gemini 3's rule: each function-call step of the
current turn must carry a signature (the first call of a parallel batch);
earlier turns are not checked.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from session_runtime.protocols.base import (
    ChatProtocol, ProtocolError, ProtocolInputError, StripOptions, StripResult, arrange, clone, known_400,
    expect_list, expect_object, expect_str, is_int, strip_result,
)
from session_runtime.protocols.canonical import Call, ChatRequest, Msg, Reasoning, Reply, Usage

SIGNATURE = "thoughtSignature"
# The documented values that skip the signature check (history from elsewhere).
SKIP_SIGNATURES = ("skip_thought_signature_validator", "context_engineering_is_the_way_to_go")
_NO_ROLE = "-role"  # layout mark: the wire turn had no role (a user turn)
_FINISH = {"STOP": "stop", "MAX_TOKENS": "length", "SAFETY": "content_filter", "RECITATION": "content_filter",
           "MALFORMED_FUNCTION_CALL": "stop"}
_REASONS = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "content_filter": "SAFETY"}
_KNOWN = (("missing a thought_signature", "gemini.thought_signature_missing"),
          ("Corrupted thought signature", "gemini.thought_signature_invalid"))


# Values that are JSON of the client's own (proto Struct), kept as they are by
# `camel_keys`; and maps whose keys are names (their values are messages).
_FREE = frozenset({"args", "response", "parametersJsonSchema", "responseJsonSchema", "labels", "default", "example",
                   "enum"})
_MAPS = frozenset({"properties"})


def camel_keys(value: Any) -> Any:
    """A body with its field names in lowerCamelCase, as Google's JSON parser
    reads either form (`include_thoughts` is `includeThoughts`; the
    google-genai SDK sends some of each). The client's own JSON inside
    (function arguments and responses, JSON schemas, labels) and the names of
    a schema's properties stay as they are."""
    if isinstance(value, list):
        return [camel_keys(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, v in value.items():
        name = _camel(key) if isinstance(key, str) else key
        if name in _FREE:
            out[name] = v
        elif name in _MAPS and isinstance(v, dict):
            out[name] = {k: camel_keys(s) for k, s in v.items()}
        else:
            out[name] = camel_keys(v)
    return out


def _camel(key: str) -> str:
    if "_" not in key.strip("_"):
        return key
    head, *rest = key.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def is_thought(part: Any) -> bool:
    return isinstance(part, dict) and part.get("thought") is True


def function_responses(msg: Msg) -> bool:
    """A user turn made only of function responses (the tool chain goes on through it)."""
    return msg.role == "user" and isinstance(msg.content, list) and bool(msg.content) and all(
        isinstance(p, dict) and "functionResponse" in p for p in msg.content)


class Gemini(ChatProtocol):
    name = "gemini"

    # -- requests ----------------------------------------------------------

    def parse_request(self, body: dict) -> ChatRequest:
        expect_object(body, "body")
        if "contents" not in body:
            raise ProtocolInputError("contents", "required")
        items = expect_list(body["contents"], "contents")
        messages = tuple(self.parse_content(c, f"contents[{i}]") for i, c in enumerate(items))
        tools = body.get("tools")
        listed = isinstance(tools, list)
        if listed:
            for i, t in enumerate(tools):
                expect_object(t, f"tools[{i}]")
                declarations = t.get("functionDeclarations")
                if declarations is not None:
                    for j, d in enumerate(expect_list(declarations, f"tools[{i}].functionDeclarations")):
                        expect_str(expect_object(d, f"tools[{i}].functionDeclarations[{j}]").get("name"),
                                   f"tools[{i}].functionDeclarations[{j}].name")
        params = {k: clone(v) for k, v in body.items() if k != "contents" and not (k == "tools" and listed)}
        return ChatRequest(messages, tuple(clone(tools)) if listed else (), params, tuple(body))

    def parse_content(self, c: Any, path: str) -> Msg:
        """One turn of `contents`."""
        expect_object(c, path)
        role = c.get("role", "user")
        if role not in ("user", "model"):
            raise ProtocolInputError(f"{path}.role", f"unknown role {role!r}; expected user or model")
        parts = expect_list(c.get("parts"), f"{path}.parts")
        for j, p in enumerate(parts):
            where = f"{path}.parts[{j}]"
            expect_object(p, where)
            if "text" in p:
                expect_str(p["text"], f"{where}.text")
            if "functionResponse" in p:
                response = expect_object(p["functionResponse"], f"{where}.functionResponse")
                expect_str(response.get("name"), f"{where}.functionResponse.name")
                if "id" in response:
                    expect_str(response["id"], f"{where}.functionResponse.id")
        extra = {k: clone(v) for k, v in c.items() if k not in ("role", "parts")}
        mark = () if "role" in c else (_NO_ROLE,)
        if role == "user":
            return Msg("user", clone(parts), extra=extra, layout=mark)
        return self.parse_parts(parts, f"{path}.parts", extra, mark)

    @staticmethod
    def parse_parts(parts: list, path: str, extra: Optional[dict] = None, mark: tuple = ()) -> Msg:
        """A model turn's parts, split into reasoning, calls and content."""
        reasoning: list[Reasoning] = []
        calls: list[Call] = []
        content: list = []
        layout: list[str] = list(mark)
        for j, part in enumerate(parts):
            where = f"{path}[{j}]"
            if is_thought(part):
                reasoning.append(Reasoning(part.get("text") if isinstance(part.get("text"), str) else "", clone(part)))
                layout.append("reasoning")
            elif "functionCall" in part:
                call = expect_object(part["functionCall"], f"{where}.functionCall")
                args = call.get("args", {})
                arguments = json.dumps(expect_object(args, f"{where}.functionCall.args"), ensure_ascii=False)
                cid = call.get("id", "")
                calls.append(Call(expect_str(cid, f"{where}.functionCall.id"),
                                  expect_str(call.get("name"), f"{where}.functionCall.name"), arguments, clone(part)))
                layout.append("call")
            else:
                content.append(clone(part))
                layout.append("content")
        return Msg("assistant", content, tuple(reasoning) if reasoning else None, tuple(calls),
                   extra=extra or {}, layout=tuple(layout))

    def render_request(self, req: ChatRequest) -> dict:
        values = {k: clone(v) for k, v in req.params.items()}
        values["contents"] = [self.render_content(m) for m in req.messages]
        if req.tools or ("tools" in req.layout and "tools" not in req.params):
            values["tools"] = clone(list(req.tools))
        return arrange(values, req.layout)

    def render_content(self, msg: Msg) -> dict:
        role = {} if _NO_ROLE in msg.layout else {"role": "model" if msg.role == "assistant" else msg.role}
        if msg.role != "assistant":
            return {**role, "parts": clone(msg.content), **clone(msg.extra)}
        return {**role, "parts": render_parts(msg), **clone(msg.extra)}

    # -- responses ---------------------------------------------------------

    def parse_response(self, body: dict) -> Reply:
        expect_object(body, "body")
        candidates = expect_list(body.get("candidates"), "candidates")
        if not candidates:
            raise ProtocolInputError("candidates", "expected at least one candidate")
        first = expect_object(candidates[0], "candidates[0]")
        content = expect_object(first.get("content", {"parts": []}), "candidates[0].content")
        message = self.parse_parts(expect_list(content.get("parts", []), "candidates[0].content.parts"),
                                   "candidates[0].content.parts")
        reason = first.get("finishReason")
        finish = None if reason is None else "tool_calls" if message.calls and reason == "STOP" else _FINISH.get(
            reason, reason)
        skip = ("candidates", "usageMetadata", "responseId")
        return Reply(message=message, usage=parse_usage(body.get("usageMetadata")), finish_reason=finish,
                     id=expect_str(body.get("responseId", ""), "responseId"),
                     extra={k: clone(v) for k, v in body.items() if k not in skip},
                     choice_extra={k: clone(v) for k, v in first.items() if k != "content"}, layout=tuple(body))

    def render_response(self, reply: Reply, model: str) -> dict:
        candidate = {"content": {"role": "model", "parts": render_parts(reply.message)}, **clone(reply.choice_extra)}
        reason = candidate.get("finishReason")
        if reason is None or reply.finish_reason != (
                "tool_calls" if reply.message.calls and reason == "STOP" else _FINISH.get(reason, reason)):
            candidate["finishReason"] = _REASONS.get(reply.finish_reason, "STOP")
        candidate.setdefault("index", 0)
        values = {"candidates": [candidate], **clone(reply.extra)}
        if reply.usage is not None:
            values["usageMetadata"] = render_usage(reply.usage)
        values.setdefault("modelVersion", model)
        if reply.id:
            values["responseId"] = reply.id
        return arrange(values, reply.layout)

    # -- outbound ----------------------------------------------------------

    def strip(self, req: ChatRequest, options: StripOptions) -> StripResult:
        """Earlier model turns lose their thought parts (`strips`); the current
        turn goes whole, and signatures stay on their parts."""
        if options.passthrough:
            return StripResult(request=req, mode="passthrough")
        boundary = self.history_boundary(req.messages, options)
        out, removed = list(req.messages), {}
        for i in range(boundary):
            m = req.messages[i]
            if self.strips(m, options):
                out[i] = without_thoughts(m)
                removed[i] = m.reasoning
        return strip_result(ChatRequest(tuple(out), req.tools, req.params, req.layout), removed)

    @staticmethod
    def history_boundary(messages: tuple[Msg, ...], options: StripOptions) -> int:
        """The current turn's first message: the last user turn that is not only
        function responses (0, none, under "all_turns")."""
        return 0 if options.context == "all_turns" else current_steps(messages).start

    @staticmethod
    def strips(m: Msg, options: StripOptions) -> bool:
        """A model turn's thought parts go, unless nothing would be left (Gemini
        refuses a turn without parts)."""
        return m.role == "assistant" and bool(m.reasoning) and bool(m.calls or m.content)

    # -- validation --------------------------------------------------------

    def validate(self, body: dict) -> Optional[ProtocolError]:
        """A body it cannot read, no contents, and Gemini 3's signature rule
        (`missing_signature`)."""
        try:
            req = self.parse_request(body)
        except ProtocolInputError as exc:
            return error(400, f"Invalid JSON payload received. {exc.path}: {exc.message}", "gemini.invalid_request")
        if not req.messages:
            return error(400, "* GenerateContentRequest.contents: contents is not specified", "gemini.invalid_request")
        missing = missing_signature(req.messages)
        if missing is not None:
            i, name = missing
            return error(400, missing_signature_message(name, i), "gemini.thought_signature_missing")
        return None

    def known_error(self, status: int, body: dict) -> Optional[str]:
        return known_400(status, body, _KNOWN)


def current_steps(messages: tuple[Msg, ...]) -> range:
    """The indexes of the current turn: from the last user turn that is not
    only function responses to the end."""
    start = next((i for i in range(len(messages) - 1, -1, -1)
                  if messages[i].role == "user" and not function_responses(messages[i])), 0)
    return range(start, len(messages))


def missing_signature(messages: tuple[Msg, ...]) -> Optional[tuple[int, str]]:
    """(the turn's index, the call's name) of the first function-call step of
    the current turn whose first call carries no signature, else None."""
    for i in current_steps(messages):
        m = messages[i]
        if m.role == "assistant" and m.calls and not (m.calls[0].opaque or {}).get(SIGNATURE):
            return i, m.calls[0].name
    return None


def missing_signature_message(name: str, index: int) -> str:
    """Gemini 3's words for a current-turn call without its signature (`index`: its turn's)."""
    return (f"Function call is missing a thought_signature in functionCall parts. This is required for tools to work "
            f"correctly, and missing thought_signature may lead to degraded model performance. Additional data, "
            f"function call `default_api:{name}` , position {index + 1}. Please refer to "
            "https://ai.google.dev/gemini-api/docs/thought-signatures for more details.")


def without_thoughts(msg: Msg) -> Msg:
    """The model turn without its thought parts; a signature that rode on a
    thought part moves to the turn's first remaining part (it must come back)."""
    signature = next((r.opaque.get(SIGNATURE) for r in msg.reasoning or () if r.opaque and r.opaque.get(SIGNATURE)),
                     None)
    layout = tuple(s for s in msg.layout if s != "reasoning")
    content, calls = list(msg.content) if isinstance(msg.content, list) else [], list(msg.calls)
    if signature is not None:
        first = next((s for s in layout if s in ("call", "content")), None)
        if first == "call" and not (calls[0].opaque or {}).get(SIGNATURE):
            c = calls[0]
            calls[0] = Call(c.id, c.name, c.arguments, {**(c.opaque or {"functionCall": {}}), SIGNATURE: signature})
        elif first == "content" and not content[0].get(SIGNATURE):
            content[0] = {**content[0], SIGNATURE: signature}
    return Msg("assistant", content, None, tuple(calls), msg.call_id, clone(msg.extra), layout)


def render_parts(msg: Msg) -> list:
    """A model turn's parts in its layout (hand-built: thoughts, then content,
    then calls)."""
    queues = {"reasoning": [r.opaque if r.opaque is not None else {"text": r.text, "thought": True}
                            for r in msg.reasoning or ()],
              "content": list(msg.content) if isinstance(msg.content, list) else
              [{"text": msg.content}] if msg.content else [],
              "call": [render_call(c) for c in msg.calls]}
    out = [queues[slot].pop(0) for slot in msg.layout if slot in queues and queues[slot]]
    for slot in ("reasoning", "content", "call"):
        out += queues[slot]
    return clone(out)


def render_call(c: Call) -> dict:
    """A functionCall part: the wire part with id and name overwritten, its
    `args` as they came while `arguments` still says them."""
    opaque = c.opaque or {}
    call = opaque.get("functionCall") if isinstance(opaque.get("functionCall"), dict) else {}
    if "args" in call and json.dumps(call["args"], ensure_ascii=False) == c.arguments:
        args = call["args"]
    else:
        try:
            args = json.loads(c.arguments) if c.arguments.strip() else {}
        except json.JSONDecodeError:
            raise ProtocolInputError(f"calls[{c.id}].arguments", "not JSON; functionCall args must be an object")
    fields = {**call, **({"id": c.id} if c.id else {}), "name": c.name, "args": args}
    if not c.id:
        fields.pop("id", None)
    return {**opaque, "functionCall": fields}


def parse_usage(raw: Any) -> Optional[Usage]:
    """Gemini's usageMetadata: `promptTokenCount` counts every input token
    (the cached ones too), `candidatesTokenCount` the answer without the
    thoughts, which `thoughtsTokenCount` counts."""
    if raw is None:
        return None
    expect_object(raw, "usageMetadata")
    prompt = raw.get("promptTokenCount", 0)
    answer, thoughts = raw.get("candidatesTokenCount", 0), raw.get("thoughtsTokenCount")
    cached = raw.get("cachedContentTokenCount")
    if not (is_int(prompt) and is_int(answer)):
        raise ProtocolInputError("usageMetadata", "expected integer token counts")
    return Usage(prompt, answer + (thoughts if is_int(thoughts) else 0), cached if is_int(cached) else None,
                 thoughts if is_int(thoughts) else None, raw=clone(raw))


def render_usage(usage: Usage) -> dict:
    if usage.raw is not None and parse_usage(usage.raw) == usage:
        return clone(usage.raw)
    thoughts = usage.reasoning_tokens or 0
    out = {"promptTokenCount": usage.prompt_tokens, "candidatesTokenCount": usage.completion_tokens - thoughts,
           "totalTokenCount": usage.prompt_tokens + usage.completion_tokens}
    if usage.cached_input_tokens:
        out["cachedContentTokenCount"] = usage.cached_input_tokens
    if usage.reasoning_tokens:
        out["thoughtsTokenCount"] = usage.reasoning_tokens
    return out


_STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                 409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def status_name(status: int) -> str:
    """Google's status name for an HTTP status."""
    return _STATUS_NAMES.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")


def error(status: int, message: str, name: str) -> ProtocolError:
    """An error in Google's body shape."""
    return ProtocolError(status, {"error": {"code": status, "message": message, "status": status_name(status)}}, name)
