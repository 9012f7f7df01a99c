"""The Gemini API: `POST /v1beta/models/{model}:generateContent` (and under
`/v1/models/`, where Google's SDK sends it by default),
`:streamGenerateContent` (`?alt=sse`: one-line `data:` frames, no `[DONE]`;
without it a JSON array of the same chunks) and `:countTokens`, served by
the local engine as steps (api/step_input.py). Model names may hold `/`;
the key comes in `x-goog-api-key` (or `?key=`) like any other key of this
server (api/auth.py), and errors are Google's `{"error": {"code",
"message", "status"}}` (api/errors.py).

Stateless like the other protocol routes: each request runs as a step of the
conversation its history continues (session inference,
session_runtime/stateless.py), named in `x-session-runtime-conversation`.
Gemini CLI drops the thought parts from the history it sends back, so a
conversation goes on at the fork, as under drop.

Thought signatures are this server's (`signatures`): an HMAC under the
server secret on the part they belong to: the first functionCall of each
step that calls tools, else the answer's text part where the step reasoned.
A function call of the current turn (from the last user text on) must come
back with its signature, or with one of the documented skip values (counted);
one without, or with another's, is 400 INVALID_ARGUMENT, as Gemini 3 answers.
Earlier turns are not checked. A signature restores nothing by itself: the
reasoning's tokens live in the conversation.

`generationConfig` gives the sampling figures (maxOutputTokens,
temperature, topP; topK and a seed are taken as the other routes take
them), `stopSequences`, `responseMimeType` with `responseSchema` or
`responseJsonSchema` (the answer's schema), and `thinkingConfig`
(includeThoughts: thought parts in the answer; thinkingBudget and
thinkingLevel bound the reasoning); `toolConfig.functionCallingConfig`
mode AUTO, NONE (no call; the tools stay in the prompt, so the cached prefix
stays the conversation's) or ANY (a call, of `allowedFunctionNames` where
given). candidateCount must be 1.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
from typing import Optional

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from session_runtime.api.auth import current_caller
from session_runtime.api.errors import GEMINI_METHODS as METHODS
from session_runtime.api.gemini_stream import Chunks, answer_parts, call_signature, finish_reason, usage_metadata
from session_runtime.api.lean_route import LeanRoute
from session_runtime.api.openai_compat import served_name
from session_runtime.api.protocol_routes import new_id, parse, read_body, step_input
from session_runtime.api.proxy_routes import validation_error
from session_runtime.api.settings import Caller
from session_runtime.api.step_input import CONVERSATION_HEADER, Stateless, StepAnswers
from session_runtime.api.streaming import cancellable
from session_runtime.api.token_count import prompt_tokens
from session_runtime.errors import InvalidRequest, RuntimeErrorBase
from session_runtime.protocols import get_protocol
from session_runtime.protocols.gemini import (
    SIGNATURE, SKIP_SIGNATURES, camel_keys, current_steps, missing_signature_message,
)
from session_runtime.server_secret import ServerSecret

PREFIXES = ("/v1beta/models/", "/v1/models/")  # Gemini CLI's and the google-genai SDK's (v1 by default)
PROTOCOL = "gemini"


class MethodNotFound(RuntimeErrorBase):
    status = 404
    error_type = "not_found"


def build(answers: StepAnswers, validate: Optional[str], runtime) -> APIRouter:
    """The Gemini routes, answering through `answers`; with `validate`
    "gemini" the server answers as Gemini's validator does (--validate): any
    model name, and a current-turn call needs a signature, anyone's."""
    router = APIRouter(route_class=LeanRoute)
    adapter = get_protocol(PROTOCOL)
    as_provider = validate == PROTOCOL

    async def call(target: str, request: Request, caller: Caller = Depends(current_caller)):
        model, _, method = target.rpartition(":")
        if method not in METHODS or not model:
            raise MethodNotFound(f"no method {method!r} on models/{model}: one of {', '.join(METHODS)}")
        name = runtime.served_names[0] if as_provider else served_name(runtime, model)
        raw = camel_keys(await read_body(request))
        if as_provider and (refused := validation_error(PROTOCOL, raw)) is not None:
            return refused
        if method == "countTokens":
            return await _count(runtime, adapter, raw, caller)
        secret: ServerSecret = request.app.state.secret
        parsed = parse(adapter, raw)  # read once, for the step and for the signatures
        inp = step_input(adapter, PROTOCOL, raw, None, parsed)
        _check_parts(raw)
        skips = 0 if as_provider else check_signatures(parsed.messages, secret)
        if skips:
            request.app.state.metrics.counters["gemini_signature_skips_total"].inc(skips)
        stream = method == "streamGenerateContent"
        inp = dataclasses.replace(inp, stream=stream, stateless=Stateless(PROTOCOL), **_generation(raw))
        thoughts = _include_thoughts(raw)
        chunks = Chunks(new_id("", 8), name, secret, thoughts)
        render = (chunks.sse if request.query_params.get("alt") == "sse" else chunks.array) if stream else None
        result = await cancellable(request, lambda cancel: answers.answer(inp, caller, cancel, render))
        if isinstance(result, StreamingResponse):
            result.headers["cache-control"] = "no-cache"
            if request.query_params.get("alt") != "sse":
                result.media_type = "application/json"
                result.headers["content-type"] = "application/json"
            return result
        body = {"candidates": [{"content": {"role": "model", "parts": answer_parts(result, secret, thoughts)},
                                "finishReason": finish_reason(result), "index": 0}],
                "usageMetadata": usage_metadata(result), "modelVersion": name, "responseId": chunks.response_id}
        return JSONResponse(body, headers={CONVERSATION_HEADER: result.conversation_id})

    for prefix in PREFIXES:
        router.add_api_route(prefix + "{target:path}", call, methods=["POST"], name=PROTOCOL + prefix)
    return router


async def _count(runtime, adapter, raw: object, caller: Caller) -> dict:
    """`{"totalTokens": N}`: the prompt tokens generateContent renders the same
    body to (cached or not); the body may wrap it in `generateContentRequest`."""
    if isinstance(raw, dict) and isinstance(raw.get("generateContentRequest"), dict):
        raw = raw["generateContentRequest"]
    inp = step_input(adapter, PROTOCOL, raw, None)
    _check_parts(raw)
    count = await anyio.to_thread.run_sync(prompt_tokens, runtime, inp.messages, inp.tools, caller.tenant)
    return {"totalTokens": count}


# What this server takes of a request: the fields it reads, and those it takes
# as Gemini does without changing the answer (safety settings, labels, a model
# name in the body). Any other is refused, as Gemini refuses an unknown field.
_FIELDS = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "safetySettings", "labels",
           "model"}
_GENERATION = {"temperature", "topP", "topK", "candidateCount", "maxOutputTokens", "stopSequences", "seed",
               "responseMimeType", "responseSchema", "responseJsonSchema", "thinkingConfig", "presencePenalty",
               "frequencyPenalty", "responseModalities"}


_PART_DATA = ("text", "functionCall", "functionResponse")
_PART_MARKS = frozenset({"thought", SIGNATURE})


def _check_parts(raw: dict) -> None:
    """Every part holds text, a functionCall or a functionResponse (with its
    marks: `thought`, a signature); any other data (images, files, code) is
    refused, naming the part, rather than left out of the prompt."""
    for i, content in enumerate(raw.get("contents") or ()):
        for j, part in enumerate(content.get("parts") or () if isinstance(content, dict) else ()):
            data = [k for k in part if k not in _PART_MARKS] if isinstance(part, dict) else []
            if len(data) != 1 or data[0] not in _PART_DATA:
                where = f"contents[{i}].parts[{j}]"
                raise InvalidRequest(f"{where}: a part of {', '.join(data) or 'nothing'} is not supported by this "
                                     "server; send text, functionCall or functionResponse parts", param=where)


def _generation(raw: dict) -> dict:
    """The StepInput fields generationConfig sets beyond the chat figures
    (topK, seed), the body's fields checked. Raises InvalidRequest in Gemini's words."""
    for key in raw:
        if key not in _FIELDS:
            raise InvalidRequest(f'Invalid JSON payload received. Unknown name "{key}": Cannot find field.',
                                 param=key)
    config = raw.get("generationConfig", {})
    if not isinstance(config, dict):
        raise InvalidRequest("generationConfig: expected an object", param="generationConfig")
    for key in config:
        if key not in _GENERATION:
            raise InvalidRequest(f'Invalid JSON payload received. Unknown name "{key}" at \'generation_config\': '
                                 "Cannot find field.", param=f"generationConfig.{key}")

    def integer(key: str, low: int) -> Optional[int]:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise InvalidRequest(f"generationConfig.{key}: expected an integer >= {low}", param=f"generationConfig.{key}")
        return value

    if integer("candidateCount", 1) not in (None, 1):
        raise InvalidRequest("generationConfig.candidateCount: this server answers one candidate",
                             param="generationConfig.candidateCount")
    for key in ("presencePenalty", "frequencyPenalty"):
        if config.get(key) not in (None, 0, 0.0):
            raise InvalidRequest(f"generationConfig.{key}: penalties are not supported; leave it out",
                                 param=f"generationConfig.{key}")
    if config.get("responseModalities") not in (None, ["TEXT"]):
        raise InvalidRequest("generationConfig.responseModalities: this server answers text only",
                             param="generationConfig.responseModalities")
    seed = config.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidRequest("generationConfig.seed: expected an integer", param="generationConfig.seed")
    return {"top_k": integer("topK", 0) or 0, "seed": seed}


def _include_thoughts(raw: object) -> bool:
    config = raw.get("generationConfig") if isinstance(raw, dict) else None
    thinking = config.get("thinkingConfig") if isinstance(config, dict) else None
    value = thinking.get("includeThoughts") if isinstance(thinking, dict) else None
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest("generationConfig.thinkingConfig.includeThoughts: expected a boolean",
                             param="generationConfig.thinkingConfig.includeThoughts")
    return bool(value)


def verified(secret: ServerSecret, signature: object, name: str, args: object) -> bool:
    """A call's signature is this server's (either base64 alphabet, padded or not)."""
    return isinstance(signature, str) and hmac.compare_digest(
        call_signature(secret, name, args), signature.rstrip("=").replace("+", "-").replace("/", "_"))


def skip_value(signature: object) -> bool:
    """One of the documented values that skip the check, as JSON text or as the
    base64 of its bytes (what Google's SDK sends for `thought_signature=b"..."`)."""
    if not isinstance(signature, str):
        return False
    if signature in SKIP_SIGNATURES:
        return True
    try:
        decoded = base64.urlsafe_b64decode(signature.replace("+", "-").replace("/", "_") + "=" * (-len(signature) % 4))
    except (ValueError, TypeError):
        return False
    return decoded.decode("utf-8", "replace") in SKIP_SIGNATURES


def check_signatures(messages, secret: ServerSecret) -> int:
    """Each function-call step of the current turn carries this server's
    signature on its first call, or a skip value. Returns how many skip values
    stood in. Raises InvalidRequest in Gemini's words."""
    skips = 0
    for i in current_steps(messages):
        m = messages[i]
        if m.role != "assistant" or not m.calls:
            continue
        first = m.calls[0]
        part = first.opaque or {}
        signature = part.get(SIGNATURE)
        args = (part.get("functionCall") or {}).get("args", {})
        if skip_value(signature):
            skips += 1
            continue
        if signature is None:
            raise InvalidRequest(missing_signature_message(first.name, i), param=f"contents[{i}].parts")
        if not verified(secret, signature, first.name, args):
            raise InvalidRequest(f"contents[{i}]: Invalid/Corrupted thought signature: it was not made by this "
                                 "server for this function call", param=f"contents[{i}].parts")
    return skips
