"""A step as Gemini's answer (`GenerateContentResponse`), whole or streamed,
rendered from the step's typed events (api/streaming.py).

Streamed, each reasoning delta (only with `includeThoughts`: a part with
`thought: true`) and each text delta is a chunk of its own; the last chunk
holds the step's function calls (this server's thought signature on the
first), or, where the step reasoned and called nothing, an empty text part
carrying the signature of the answer's text, and the `finishReason`. Every
chunk carries `usageMetadata` as running totals (the prompt's from the
start, the output's at the end), as Gemini's do; Gemini CLI keeps the last.
With `alt=sse` a chunk is one `data:` line and a blank line, and nothing
follows the last; without it the chunks make one JSON array. An error after
the stream began is a chunk of Google's error object, and the stream ends.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

from session_runtime.api.streaming import Event, Prefill
from session_runtime.api.errors import gemini_body
from session_runtime.protocols.gemini import SIGNATURE
from session_runtime.server_secret import ServerSecret
from session_runtime.step import Step


def _signature(secret: ServerSecret, kind: str, *fields: str) -> str:
    return secret.sign("\x00".join((kind, *fields)))


def call_signature(secret: ServerSecret, name: str, args: object) -> str:
    """This server's thought signature of a function call (its name and arguments)."""
    return _signature(secret, "functionCall", name, json.dumps(args, sort_keys=True, ensure_ascii=False))


def text_signature(secret: ServerSecret, text: str) -> str:
    """This server's thought signature of an answer's text (where the step reasoned and called nothing)."""
    return _signature(secret, "text", text)


def call_parts(step: Step, secret: ServerSecret) -> list[dict]:
    """The step's function calls as parts, the first signed (Gemini signs the
    first call of a parallel batch)."""
    parts = []
    for k, c in enumerate(step.tool_calls):
        part: dict = {"functionCall": {"id": c["id"], "name": c["name"], "args": c["arguments"]}}
        if k == 0:
            part[SIGNATURE] = call_signature(secret, c["name"], c["arguments"])
        parts.append(part)
    return parts


def answer_parts(step: Step, secret: ServerSecret, thoughts: bool) -> list[dict]:
    """A whole answer's parts: the thoughts (with includeThoughts), the text, the calls."""
    parts: list[dict] = [{"text": step.reasoning, "thought": True}] if thoughts and step.reasoning else []
    if step.content or (step.reasoning and not step.tool_calls):
        text: dict = {"text": step.content or ""}
        if step.reasoning and not step.tool_calls:
            text[SIGNATURE] = text_signature(secret, step.content or "")
        parts.append(text)
    return parts + call_parts(step, secret)


def usage_metadata(step: Step) -> dict:
    """A step's usage in Gemini's names: `promptTokenCount` counts the whole
    prompt, `cachedContentTokenCount` what of it was reused from the cache
    (device or host), `candidatesTokenCount` the output without the thoughts,
    which `thoughtsTokenCount` counts."""
    acc = step.accounting
    cached = (acc.cached_input_tokens or 0) + acc.host_loaded_tokens
    thoughts = step.reasoning_tokens or 0
    out = {"promptTokenCount": acc.prompt_tokens, "candidatesTokenCount": acc.output_tokens - thoughts,
           "totalTokenCount": acc.prompt_tokens + acc.output_tokens}
    if cached:
        out["cachedContentTokenCount"] = cached
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    return out


def finish_reason(step: Step) -> str:
    """Gemini's finishReason for a step (a call ends on STOP, as Gemini's do)."""
    return "MAX_TOKENS" if step.finish_reason == "length" else "STOP"


class Chunks:
    """One answer's stream state: its id, model, secret and whether thoughts
    are shown; `sse` and `array` render the step's events."""

    def __init__(self, response_id: str, model: str, secret: ServerSecret, thoughts: bool):
        self.response_id, self.model, self.secret, self.thoughts = response_id, model, secret, thoughts
        self.usage: dict = {"promptTokenCount": 0, "totalTokenCount": 0}

    def chunk(self, parts: list[dict], finish: Optional[str] = None) -> dict:
        candidate: dict = {"content": {"role": "model", "parts": parts}}
        if finish is not None:
            candidate["finishReason"] = finish
        candidate["index"] = 0
        return {"candidates": [candidate], "usageMetadata": dict(self.usage), "modelVersion": self.model,
                "responseId": self.response_id}

    def chunks(self, events: Iterator[Event]) -> Iterator[dict]:
        """The answer's chunks for the step's typed events."""
        for kind, value in events:
            if kind == "prefill":
                assert isinstance(value, Prefill)
                self.usage = {"promptTokenCount": value.prompt_tokens, "totalTokenCount": value.prompt_tokens}
                if value.cached_tokens:
                    self.usage["cachedContentTokenCount"] = value.cached_tokens
            elif kind == "reasoning" and self.thoughts:
                yield self.chunk([{"text": value, "thought": True}])
            elif kind == "content":
                yield self.chunk([{"text": value}])
            elif kind == "error":
                yield gemini_body(value)[1]  # Google's status and body, as the error handlers answer it
                return
            elif kind == "step":
                self.usage = usage_metadata(value)
                parts = call_parts(value, self.secret)
                if not parts and value.reasoning:
                    parts = [{"text": "", SIGNATURE: text_signature(self.secret, value.content or "")}]
                yield self.chunk(parts, finish_reason(value))

    def sse(self, events: Iterator[Event]) -> Iterator[str]:
        for c in self.chunks(events):
            yield f"data: {json.dumps(c, ensure_ascii=False)}\r\n\r\n"

    def array(self, events: Iterator[Event]) -> Iterator[str]:
        first = True
        for c in self.chunks(events):
            yield ("[" if first else ",\r\n") + json.dumps(c, ensure_ascii=False)
            first = False
        yield "[]" if first else "]"
