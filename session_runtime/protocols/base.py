"""The protocol adapter contract, its typed results, and helpers every adapter uses."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from session_runtime.protocols.canonical import ChatRequest, Msg, Reasoning, Reply
from session_runtime.weak_memo import WeakMemo, WireMessage

PASSTHROUGH_ENV = "SESSION_RUNTIME_REASONING_PASSTHROUGH"
CHAT_PROTOCOLS = ("deepseek", "openai-chat")  # Chat Completions: one message shape, /chat/completions


class ProtocolInputError(ValueError):
    """A body the protocol cannot read. `path` names the JSON field at fault
    (`messages[3].tool_calls[0].function.arguments`)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class ProtocolError:
    """A refusal in the provider's own shape: its status, its body and our
    stable name for it (`deepseek.reasoning_content_missing`)."""

    status: int
    body: dict
    name: str


@dataclass(frozen=True)
class StripOptions:
    """How the outbound stripper treats historical reasoning.

    passthrough: send everything as received (the escape hatch).
    keep_tool_turns: keep the reasoning of completed turns that made tool calls
        (DeepSeek's documented rule; Anthropic: their thinking blocks).
    context: Responses' `reasoning.context`; "all_turns" keeps every turn's
        reasoning (Anthropic: keep every turn's thinking too).
    rewrite_nudge: DeepSeek; trailing system messages after a final assistant
        go out as `user`, which makes the request's shape lenient.
    """

    passthrough: bool = False
    keep_tool_turns: bool = False
    context: Optional[str] = None
    rewrite_nudge: bool = True


@dataclass(frozen=True)
class StripResult:
    """A stripped copy of a request and what was taken out of it.

    mode: "passthrough" (sent as received by request), "strict" (sent as
    received because the shape demands every reasoning block) or "lenient"
    (historical reasoning stripped). `stripped_indexes` are indexes into
    `request.messages`; `stripped_texts` holds, per stripped message, the text
    of the reasoning it lost (tokens are the caller's to count);
    `stripped_bytes` is their UTF-8 size and `stripped_opaque_bytes` the size
    of the continuation state dropped with them (signatures, encrypted
    content) as compact JSON.
    """

    request: ChatRequest
    mode: str
    stripped_indexes: tuple[int, ...] = ()
    stripped_texts: tuple[str, ...] = ()
    stripped_bytes: int = 0
    stripped_opaque_bytes: int = 0
    nudge_rewritten: bool = False
    rewritten_indexes: tuple[int, ...] = ()


def strip_result(request: ChatRequest, removed: Mapping[int, tuple[Reasoning, ...]],
                 rewritten: tuple[int, ...] = ()) -> StripResult:
    """The lenient-mode result for `request` (already stripped) and the blocks
    taken out of each message index."""
    indexes = tuple(sorted(removed))
    texts = tuple("\n\n".join(r.text for r in removed[i] if r.text) for i in indexes)
    opaque = sum(len(compact(r.opaque).encode("utf-8")) for i in indexes for r in removed[i] if r.opaque is not None)
    return StripResult(request=request, mode="lenient", stripped_indexes=indexes, stripped_texts=texts,
                       stripped_bytes=sum(len(t.encode("utf-8")) for t in texts), stripped_opaque_bytes=opaque,
                       nudge_rewritten=bool(rewritten), rewritten_indexes=rewritten)


def passthrough_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when $SESSION_RUNTIME_REASONING_PASSTHROUGH is "1"."""
    return (os.environ if environ is None else environ).get(PASSTHROUGH_ENV) == "1"


class ChatProtocol(ABC):
    """One provider protocol. Every method is pure: bodies and requests given
    are never changed, and what is returned shares no mutable state with them."""

    name: str

    @abstractmethod
    def parse_request(self, body: dict) -> ChatRequest:
        """The canonical request of a request body. Raises ProtocolInputError
        naming the field of a body of the wrong shape."""

    @abstractmethod
    def render_request(self, req: ChatRequest) -> dict:
        """The request body; `render_request(parse_request(b)) == b`."""

    @abstractmethod
    def parse_response(self, body: dict) -> Reply:
        """The reply of a non-streaming response body. Raises ProtocolInputError."""

    @abstractmethod
    def render_response(self, reply: Reply, model: str) -> dict:
        """A non-streaming response body answering as `model`."""

    @abstractmethod
    def strip(self, req: ChatRequest, options: StripOptions) -> StripResult:
        """A copy of `req` with historical reasoning removed by the protocol's
        outbound rules, and the report of what was removed."""

    @abstractmethod
    def validate(self, body: dict) -> Optional[ProtocolError]:
        """The provider's refusal of `body`, where its rules are known, else None."""

    @abstractmethod
    def known_error(self, status: int, body: dict) -> Optional[str]:
        """Our name for a provider error this protocol documents, else None."""


class MessagesHistory(ABC):
    """A protocol whose body is a `messages` list that the lenient rule strips
    message by message (Chat Completions, Anthropic): every message before a
    boundary (`history_boundary`) loses its reasoning when `strips` says so,
    the rest goes as it came. So a conversation's request can be built past
    its last one (`proxy/outbound.py`, `_prepare_past`).

    A conversation's history goes out at every step: the messages built from
    stored ones (`WireMessage`) are parsed, stripped and rendered once each,
    for as long as they live (`WeakMemo`); a client's own dicts every time."""

    @abstractmethod
    def parse_message(self, m: Any, path: str) -> Msg: ...

    @abstractmethod
    def render_message(self, msg: Msg) -> dict: ...

    @abstractmethod
    def history_boundary(self, messages: tuple[Msg, ...], options: StripOptions) -> Optional[int]:
        """The index before which messages are history (stripped by `strips`),
        or None when the request goes out by another rule (it is then stripped whole)."""

    @staticmethod
    @abstractmethod
    def strips(m: Msg, options: StripOptions) -> bool:
        """Whether `m`, a history message, loses its reasoning."""

    @functools.cached_property
    def _memos(self) -> tuple[WeakMemo, WeakMemo, WeakMemo]:
        return WeakMemo(), WeakMemo(), WeakMemo()  # parse, without_reasoning, render

    def _parse_known(self, m: Any, path: str) -> Msg:
        if type(m) is not WireMessage:
            return self.parse_message(m, path)
        return self._memos[0].get(m, lambda m: self.parse_message(m, path))

    def _render_known(self, msg: Msg) -> dict:
        return self._memos[2].get(msg, self.render_message)

    def without_reasoning(self, msg: Msg) -> Msg:
        """The message with its reasoning removed, everything else as it was."""
        return self._memos[1].get(msg, self._without_reasoning)

    def _without_reasoning(self, msg: Msg) -> Msg:
        return dataclasses.replace(msg, reasoning=None)

    def strip_history(self, req: ChatRequest, messages: tuple[Msg, ...], boundary: int, options: StripOptions,
                      rewritten: tuple[int, ...] = ()) -> StripResult:
        """The lenient result: each message before `boundary` that `strips` says
        loses its reasoning; the rest keeps everything."""
        out = list(messages)
        removed: dict[int, tuple[Reasoning, ...]] = {}
        for i in range(max(boundary, 0)):
            m = messages[i]
            if self.strips(m, options):
                out[i] = self.without_reasoning(m)
                removed[i] = m.reasoning
        return strip_result(dataclasses.replace(req, messages=tuple(out)), removed, rewritten)


# -- helpers ---------------------------------------------------------------


def clone(value: Any) -> Any:
    """A copy of a JSON value sharing no list or dict with it."""
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v) for v in value]
    return value


_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def compact(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))`, by one encoder
    (`json.dumps` with arguments builds an encoder per call: a step writes ~10 such texts)."""
    return _COMPACT.encode(value)


def parse_messages_request(body: Any, parse_message, parse_all=None) -> ChatRequest:
    """A body with a `messages` list (Chat Completions, Anthropic): each message
    by `parse_message(m, path)` (or the whole list by `parse_all(items)`), the
    tools when they are a list (a `tools: null` stays a param, verbatim), every
    other field a param, the key order kept."""
    expect_object(body, "body")
    if "messages" not in body:
        raise ProtocolInputError("messages", "required")
    items = expect_list(body["messages"], "messages")
    if parse_all is not None:
        messages = tuple(parse_all(items))
    else:
        messages = tuple(parse_message(m, f"messages[{i}]") for i, m in enumerate(items))
    tools = body.get("tools")
    listed = isinstance(tools, list)
    params = {k: clone(v) for k, v in body.items() if k != "messages" and not (k == "tools" and listed)}
    return ChatRequest(messages, tuple(clone(tools)) if listed else (), params, tuple(body))


def render_messages_request(req: ChatRequest, render_message, rendered: Optional[list] = None) -> dict:
    """A body with a `messages` list (Chat Completions, Anthropic): the params,
    the messages rendered (or `rendered`, already) and the tools, in the wire's key order."""
    values = {k: clone(v) for k, v in req.params.items()}
    values["messages"] = rendered if rendered is not None else [render_message(m) for m in req.messages]
    if req.tools or ("tools" in req.layout and "tools" not in req.params):
        values["tools"] = clone(list(req.tools))
    return arrange(values, req.layout)


def expect_ints(raw: dict, keys: tuple[str, ...], path: str) -> None:
    """Each of `keys` of `raw` is an integer. Raises ProtocolInputError naming `path.key`."""
    for key in keys:
        if not is_int(raw.get(key)):
            raise ProtocolInputError(f"{path}.{key}", "expected an integer")


def arrange(values: dict, layout: tuple[str, ...]) -> dict:
    """`values` with the keys named in `layout` first, in that order, then the rest."""
    out = {k: values[k] for k in layout if k in values}
    out.update((k, v) for k, v in values.items() if k not in out)
    return out


def expect_object(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ProtocolInputError(path, f"expected an object, got {type_name(value)}")
    return value


def expect_list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise ProtocolInputError(path, f"expected an array, got {type_name(value)}")
    return value


def expect_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ProtocolInputError(path, f"expected a string, got {type_name(value)}")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def type_name(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def dig(value: Any, *keys: str) -> Any:
    """value[k1][k2]... or None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def error_message(body: Any) -> str:
    """The error text of a provider's error body of any shape, else ""."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(body.get("message"), str):
            return body["message"]
    return body if isinstance(body, str) else ""


def known_400(status: int, body: dict, known: tuple[tuple[str, str], ...]) -> Optional[str]:
    """The name of a 400 whose message holds one of `known`'s (needle, name) needles, else None."""
    if status != 400:
        return None
    text = error_message(body)
    return next((name for needle, name in known if needle in text), None)


def openai_error(status: int, name: str, message: str, param: Optional[str] = None,
                 code: Optional[str] = None) -> ProtocolError:
    """An error in OpenAI's body shape (DeepSeek's too)."""
    return ProtocolError(status, {"error": {"message": message, "type": "invalid_request_error",
                                            "param": param, "code": code}}, name)


def last_index(messages: tuple[Msg, ...], role: str) -> int:
    """The index of the last message of `role`, -1 if none."""
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == role), -1)
