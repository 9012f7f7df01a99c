"""The canonical history every protocol adapter parses into and renders from.

A parsed request keeps everything the wire said: content exactly as received
(`null`, `""` or a list of parts), each reasoning block's and call's
continuation state verbatim (`opaque`), the fields no adapter models (`extra`)
and the wire's own layout (`layout`: key order of a chat message, block order
of an Anthropic message, item order of a Responses turn). Rendering a parsed
request therefore gives back the same JSON, byte for byte; a message built by
hand (empty `layout`) renders in the protocol's default layout.

Containers passed as lists are stored as tuples, so two requests compare
equal however they were built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Reasoning:
    """One reasoning block. `opaque` is the protocol's continuation state,
    verbatim and never edited: an Anthropic `thinking` or `redacted_thinking`
    block, a Responses `reasoning` item (id, summary, encrypted_content,
    status). None for plain-text reasoning (DeepSeek's `reasoning_content`)."""

    text: str
    opaque: Optional[dict] = None


@dataclass(frozen=True)
class Call:
    """One tool call. `arguments` is the JSON text as the wire had it (for
    Anthropic, whose `input` is an object, its `json.dumps`; the object itself
    is in `opaque` and goes back unchanged while `arguments` is unedited).
    `opaque` is the wire's call object verbatim (a chat `tool_calls[i]`, an
    Anthropic `tool_use` block, a Responses `function_call` item); rendering
    overwrites only the modelled fields in a copy of it."""

    id: str
    name: str
    arguments: str
    opaque: Optional[dict] = None


@dataclass(frozen=True)
class Msg:
    """One message of the history.

    `reasoning` is None when the wire had no reasoning at all (DeepSeek tells an
    absent `reasoning_content` from `""`), an empty tuple or blocks otherwise.
    `call_id` is set on tool results. `extra` holds wire fields no adapter
    models (`name`, `refusal`, `annotations`, `audio`, item ids, ...),
    verbatim. `layout` is private to the protocol that parsed the message; a
    converter resets it.
    """

    role: str
    content: Any = None
    reasoning: Optional[tuple[Reasoning, ...]] = None
    calls: tuple[Call, ...] = ()
    call_id: Optional[str] = None
    extra: dict = field(default_factory=dict)
    layout: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.reasoning is not None and not isinstance(self.reasoning, tuple):
            object.__setattr__(self, "reasoning", tuple(self.reasoning))
        if not isinstance(self.calls, tuple):
            object.__setattr__(self, "calls", tuple(self.calls))
        if not isinstance(self.layout, tuple):
            object.__setattr__(self, "layout", tuple(self.layout))


@dataclass(frozen=True)
class ChatRequest:
    """A request body: the history, the tools as the wire had them, and every
    other top-level field verbatim in `params` (model, thinking, reasoning,
    include, store, max_tokens, and the top-level system prompt where the
    protocol has one: Anthropic's `system`, Responses' `instructions`).
    `layout` is the top-level key order."""

    messages: tuple[Msg, ...]
    tools: tuple = ()
    params: dict = field(default_factory=dict)
    layout: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("messages", "tools", "layout"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class Usage:
    """A provider's token usage in one vocabulary. `prompt_tokens` counts every
    input token, cached or not (for Anthropic: input + cache read + cache
    creation). A figure the provider did not report is None, never guessed.
    `raw` is the provider's usage object verbatim; rendering gives it back
    while the modelled fields still match it."""

    prompt_tokens: int
    completion_tokens: int
    cached_input_tokens: Optional[int] = None
    reasoning_tokens: Optional[int] = None
    raw: Optional[dict] = None


@dataclass(frozen=True)
class Reply:
    """A parsed non-streaming response. `finish_reason` is in chat's vocabulary
    (stop, length, tool_calls, content_filter; None when the provider gave
    none); the protocol's own value stays in `extra` (Anthropic's
    `stop_reason`, Responses' `status`). `extra` holds the other top-level
    fields verbatim, `choice_extra` a chat choice's other fields (index,
    logprobs), `layout` the top-level key order."""

    message: Msg
    usage: Optional[Usage]
    finish_reason: Optional[str]
    id: str
    extra: dict = field(default_factory=dict)
    choice_extra: dict = field(default_factory=dict)
    layout: tuple[str, ...] = ()


def reasoning_text(msg: Msg) -> str:
    """The message's reasoning as one text: its blocks' texts joined by a blank
    line (blocks without text, such as redacted thinking, are skipped)."""
    if not msg.reasoning:
        return ""
    return "\n\n".join(r.text for r in msg.reasoning if r.text)

