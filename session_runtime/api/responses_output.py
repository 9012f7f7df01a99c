"""The Responses objects `/v1/responses` answers with, built from the chat
route's answer: the response (`resp_`), its output items (reasoning `rs_`,
message `msg_`, function call `fc_` with a `call_` id) and its usage.

Plain and streamed answers build their items here, so the two agree item for
item. Ids are random (192 bits): a response id is also the id of the
conversation it is stored as, and must not be guessable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from session_runtime.api.protocol_routes import new_id
from session_runtime.protocols.base import dig

Encrypt = Callable[[str], str]


@dataclass
class OutputIds:
    """The ids of one response's items, drawn once so that a streamed item keeps
    its id from `output_item.added` to `response.completed`. `calls` maps the
    runtime's id of each tool call to (item id, call_id); it fills as calls come."""

    response: str = field(default_factory=lambda: new_id("resp_", 24))
    reasoning: str = field(default_factory=lambda: new_id("rs_", 24))
    message: str = field(default_factory=lambda: new_id("msg_", 24))
    calls: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The conversation's call ids go out as they are (an inferred conversation's:
    # random, in this form, echoed back by a client that keeps no state).
    own_calls: bool = False

    def call(self, internal: str) -> tuple[str, str]:
        if internal not in self.calls:
            self.calls[internal] = (new_id("fc_", 24), internal if self.own_calls else new_id("call_", 24))
        return self.calls[internal]

    def call_ids(self) -> dict[str, str]:
        """call_id -> the runtime's id, for the tool results that will answer them."""
        return {call_id: internal for internal, (_, call_id) in self.calls.items()}


def reasoning_item(ids: OutputIds, text: Optional[str], encrypt: Optional[Encrypt]) -> dict:
    """A reasoning item; `text` None: as added, before any text. With `encrypt`
    (`include: ["reasoning.encrypted_content"]`) the text also goes out
    encrypted under the server's secret, for a client that keeps no state
    (`store: false`) to send back."""
    item = {"id": ids.reasoning, "type": "reasoning", "summary": [],
            "content": [] if text is None else [reasoning_part(text)]}
    if encrypt is not None and text is not None:
        item["encrypted_content"] = encrypt(text)
    return item


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def message_item(ids: OutputIds, text: Optional[str], status: str) -> dict:
    return {"id": ids.message, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(ids: OutputIds, call: dict, arguments: Optional[str], status: str) -> dict:
    """A function_call item for one of the chat completion's `tool_calls`."""
    item_id, call_id = ids.call(call["id"])
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": call["function"]["name"], "arguments": arguments if arguments is not None else ""}


def output_items(ids: OutputIds, reasoning: str, content: str, calls: list[dict], incomplete: bool,
                 encrypt: Optional[Encrypt]) -> list[dict]:
    """A turn's items as a plain answer lists them: reasoning, the message (when
    there is text, or nothing else at all), then the calls."""
    items = [reasoning_item(ids, reasoning, encrypt)] if reasoning else []
    if content or not (reasoning or calls):
        items.append(message_item(ids, content, "incomplete" if incomplete else "completed"))
    items += [call_item(ids, c, c["function"]["arguments"], "completed") for c in calls]
    return items


def shell(raw: dict, ids: OutputIds, model: str, temperature: float, top_p: float, store: bool) -> dict:
    """The response before any output (`response.created`): what the request
    asked for, echoed as OpenAI echoes it."""
    tools = raw.get("tools") if isinstance(raw.get("tools"), list) else []
    return {
        "id": ids.response, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": raw.get("instructions"), "max_output_tokens": raw.get("max_output_tokens"),
        "model": model, "output": [], "parallel_tool_calls": raw.get("parallel_tool_calls", True) is not False,
        "previous_response_id": raw.get("previous_response_id"),
        "reasoning": {"effort": dig(raw, "reasoning", "effort"), "summary": dig(raw, "reasoning", "summary")},
        "store": store, "temperature": temperature, "text": {"format": {"type": "text"}},
        "tool_choice": raw.get("tool_choice") or "auto", "tools": tools, "top_p": top_p, "truncation": "disabled",
        "usage": None, "user": raw.get("user"), "metadata": raw.get("metadata") or {},
    }


def finished(base: dict, output: list[dict], finish_reason: Optional[str], usage: Optional[dict]) -> dict:
    """The whole response: `incomplete` with reason max_output_tokens when the
    step ran out of tokens (as OpenAI reports it), else `completed`."""
    incomplete = finish_reason == "length"
    return {**base, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "usage": response_usage(usage)}


def failed(base: dict, output: list[dict], error: dict) -> dict:
    """The response of a step that failed after the stream started."""
    code = "rate_limit_exceeded" if error.get("code") in ("rate_limit_exceeded", "conversation_limit") else \
        "server_error"
    return {**base, "status": "failed", "output": output,
            "error": {"code": code, "message": str(error.get("message") or "the step failed")}}


def response_usage(usage: Optional[dict]) -> Optional[dict]:
    """Chat usage in Responses' names (cached input, reasoning output)."""
    if usage is None:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": dig(usage, "prompt_tokens_details", "cached_tokens") or 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens":
                                      dig(usage, "completion_tokens_details", "reasoning_tokens") or 0},
            "total_tokens": prompt + completion}
