"""The way out to a provider: parse the request in its protocol, strip
historical reasoning by that protocol's rules, count what was stripped, send
it, and name the provider's error when it refuses.

Every outbound path (a conversation's steps, a stateless chat completion, a
summary or compaction request a client sends through the proxy) goes through
`Outbound.send`, so one stripper decides what leaves the machine. The request
given is never changed: it is the client's transcript.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Optional

from session_runtime.accounting import plain_dict
from session_runtime.errors import InvalidRequest, UpstreamError, UpstreamUnavailable
from session_runtime.protocols import get_protocol
from session_runtime.protocols.base import (
    MessagesHistory, ProtocolInputError, StripOptions, error_message, parse_messages_request, render_messages_request,
)
from session_runtime.protocols.canonical import ChatRequest, Msg, Reply, reasoning_text
from session_runtime.proxy.client import UpstreamClient
from session_runtime.proxy.prefix import OutboundPrefix
from session_runtime.weak_memo import WeakMemo


@dataclass(frozen=True)
class StripAccount:
    """What the stripper did to one request, for the step's accounting and errors.

    Tokens are counted with the conversation's template tokenizer over every
    text of the request (system, messages, reasoning, tool calls and results);
    bytes are UTF-8. The provider's own count is in its usage.
    """

    protocol: str
    mode: str  # passthrough, strict (sent as received), or lenient (stripped)
    nudge_rewritten: bool  # a trailing system message after an assistant went out as user
    messages_stripped: int
    stripped_tokens: int
    stripped_bytes: int
    request_tokens: int  # the request as received
    reasoning_tokens: int  # reasoning in the request as received
    sent_tokens: int
    sent_reasoning_tokens: int

    @property
    def reasoning_share(self) -> float:
        """Reasoning over all tokens of the request as the client sent it."""
        return self.reasoning_tokens / self.request_tokens if self.request_tokens else 0.0

    @property
    def sent_reasoning_share(self) -> float:
        return self.sent_reasoning_tokens / self.sent_tokens if self.sent_tokens else 0.0

    def as_dict(self) -> dict:
        return {**plain_dict(self), "reasoning_share": round(self.reasoning_share, 4),
                "sent_reasoning_share": round(self.sent_reasoning_share, 4)}


@dataclass(frozen=True)
class Forwarded:
    reply: Reply  # the provider's answer, parsed
    body: dict  # the provider's response body, verbatim
    sent: dict  # the request body as it went out
    strip: StripAccount
    elapsed_ms: float


class Outbound:
    """One provider, one protocol, one stripper configuration. Thread-safe."""

    def __init__(self, client: UpstreamClient, count_tokens: Callable[[str], int], options: StripOptions,
                 model: Optional[str] = None):
        self.client = client
        self.protocol = get_protocol(client.protocol)
        self.count = count_tokens
        self.options = options
        self.model = model  # sent instead of the request's model, when set
        self._counted = WeakMemo()

    def prepare(self, body: dict, prefix: Optional[OutboundPrefix] = None) -> tuple[dict, StripAccount]:
        """The body as it will go out, and what the stripper did. Raises
        InvalidRequest (400) naming the field of a body the protocol cannot read.
        `prefix`: the conversation's last request, for a body built from its
        stored messages (`transcript.request_body`), so that only what follows
        it is worked on; the same body and account as without it."""
        sent, account, _ = self._prepare(body, prefix)
        return sent, account

    def _prepare(self, body: dict, prefix: Optional[OutboundPrefix]) -> tuple[dict, StripAccount, Optional[bytes]]:
        """`prepare`, and the body's JSON when it was written from its messages' own (else None)."""
        try:
            if prefix is not None and isinstance(self.protocol, MessagesHistory) and not self.options.passthrough:
                prepared = self._prepare_past(prefix, body)
                if prepared is not None:
                    return prepared
            request = self.protocol.parse_request(body)
        except ProtocolInputError as exc:
            raise InvalidRequest(f"{exc}", param=getattr(exc, "path", None)) from None
        result = self.protocol.strip(request, self.options)
        sent = self.protocol.render_request(result.request)
        if self.model is not None:
            sent = {**sent, "model": self.model}
        return sent, self._account(request, result), None

    def _prepare_past(self, prefix: OutboundPrefix, body: dict) -> Optional[tuple[dict, StripAccount, bytes]]:
        """`_prepare` for a `messages` body (Chat Completions, Anthropic) by the
        lenient rule, working only past the conversation's last request: each
        message is parsed, stripped (when it is before the protocol's history
        boundary), rendered, counted and written as JSON once, and again only
        when the boundary passes it. None for a shape stripped by another rule
        (DeepSeek's strict one: sent as a whole)."""
        p = self.protocol
        request = parse_messages_request(body, None, lambda items: prefix.parsed.map(
            items, lambda i, m: p._parse_known(m, f"messages[{i}]")))
        messages = request.messages
        boundary = p.history_boundary(messages, self.options)
        if boundary is None:
            return None
        figures = prefix.sent.map(messages, lambda i, m: self._figures(m, i < boundary),
                                  start=min(prefix.sent.tag or 0, boundary), tag=boundary)
        sent = render_messages_request(request, None, [f[0] for f in figures])
        if self.model is not None:
            sent = {**sent, "model": self.model}
        total, reasoning, stripped, stripped_tokens, stripped_bytes = (
            sum(map(itemgetter(j), figures)) for j in range(1, 6))
        total += self._other_tokens(request)
        account = StripAccount(
            protocol=self.client.protocol, mode="lenient", nudge_rewritten=False, messages_stripped=stripped,
            stripped_tokens=stripped_tokens, stripped_bytes=stripped_bytes, request_tokens=total,
            reasoning_tokens=reasoning, sent_tokens=total - stripped_tokens,
            sent_reasoning_tokens=reasoning - stripped_tokens)
        return sent, account, encode_with(sent, [f[6] for f in figures])

    def _figures(self, m: Msg, history: bool) -> tuple[dict, int, int, int, int, int, str]:
        """One message of a request: (its form on the wire, its tokens, its
        reasoning tokens, 1 if stripped, the stripped tokens, the stripped bytes,
        its JSON) -- stripped by the lenient rule when it is `history` (before the
        boundary), as `MessagesHistory.strip_history` and `strip_result` do."""
        p = self.protocol
        tokens, reasoning = self._counted.get(m, self._message_tokens)
        stripped, text = history and p.strips(m, self.options), ""
        if stripped:
            text = "\n\n".join(r.text for r in m.reasoning if r.text)
            m = p.without_reasoning(m)
        wire = p._render_known(m)
        return (wire, tokens, reasoning, int(stripped), self.count(text) if stripped else 0,
                len(text.encode("utf-8")), json.dumps(wire, ensure_ascii=False))

    def send(self, body: dict, prefix: Optional[OutboundPrefix] = None) -> Forwarded:
        """Strip and send `body`; raises UpstreamError with the provider's status
        when it refuses, UpstreamUnavailable when it cannot answer."""
        sent, account, encoded = self._prepare(body, prefix)
        response = self.client.post(sent, encoded)
        if not response.ok:
            raise self.refused(response.status, response.body, account)
        if not isinstance(response.body, dict):
            raise UpstreamUnavailable(f"the upstream answered {response.status} with a body that is not JSON",
                                      details={"body": str(response.body)[:2000], "stripper": account.as_dict()})
        try:
            reply = self.protocol.parse_response(response.body)
        except (ProtocolInputError, ValueError, KeyError, TypeError) as exc:
            raise UpstreamUnavailable(f"the upstream's answer is not a {self.client.protocol} response: {exc}",
                                      details={"body": response.body, "stripper": account.as_dict()}) from None
        return Forwarded(reply, response.body, sent, account, response.elapsed_ms)

    def refused(self, status: int, body: object, account: StripAccount) -> UpstreamError:
        """The provider's 4xx in our error shape: its body, its known name, and
        what the stripper did (the usual cause of a reasoning 400)."""
        name = self.protocol.known_error(status, body if isinstance(body, dict) else {})
        message = error_message(body) or str(body)[:500]
        hint = ""
        if name is not None:
            hint = f" (known provider error {name}; the stripper ran in {account.mode} mode"
            hint += ", rewrote a trailing nudge" if account.nudge_rewritten else ""
            hint += f", stripped reasoning from {account.messages_stripped} message(s))"
        return UpstreamError(f"the upstream refused the request with {status}: {message}{hint}", status,
                             {"status": status, "body": body, "known_error": name, "stripper": account.as_dict()})

    def _account(self, request: ChatRequest, result) -> StripAccount:
        total, reasoning = self._tokens(request)
        # The stripper only takes reasoning out (a rewritten nudge keeps its text):
        # what is sent is what came, less what it took; no second count.
        stripped = sum(self.count(t) for t in result.stripped_texts)
        return StripAccount(
            protocol=self.client.protocol, mode=result.mode, nudge_rewritten=result.nudge_rewritten,
            messages_stripped=len(result.stripped_indexes), stripped_tokens=stripped,
            stripped_bytes=result.stripped_bytes, request_tokens=total, reasoning_tokens=reasoning,
            sent_tokens=total - stripped, sent_reasoning_tokens=reasoning - stripped,
        )

    def _tokens(self, request: ChatRequest) -> tuple[int, int]:
        """(tokens of every text of the request, tokens of its reasoning)."""
        counts = [self._counted.get(m, self._message_tokens) for m in request.messages]
        reasoning = sum(r for _, r in counts)
        return sum(t for t, _ in counts) + self._other_tokens(request), reasoning

    def _other_tokens(self, request: ChatRequest) -> int:
        """Tokens of the request's texts outside its messages: a top-level system prompt and the tools."""
        other = [_text(request.params.get(k)) for k in ("system", "instructions")]
        instruction = request.params.get("systemInstruction")  # Gemini's: a content of parts
        if isinstance(instruction, dict):
            other.append(_text(instruction.get("parts")))
        if request.tools:
            other.append(json.dumps(request.tools, ensure_ascii=False))
        return sum(self.count(t) for t in other if t)

    def _message_tokens(self, m: Msg) -> tuple[int, int]:
        """(tokens of every text of one message, tokens of its reasoning); kept
        for as long as the parsed message lives (see protocols/chat.py)."""
        reasoning = self.count(reasoning_text(m))
        other = [_text(m.content), *(c.arguments for c in m.calls)]
        return reasoning + sum(self.count(t) for t in other if t), reasoning


_HOLE = f"messages {uuid.uuid4()}"  # where a body's messages go in its JSON (encode_with)
_HOLE_JSON = json.dumps(_HOLE)


def encode_with(body: dict, messages: list[str]) -> bytes:
    """`json.dumps(body, ensure_ascii=False)` (UTF-8), with `body["messages"]`'s
    items given as their JSON texts: the history's were written once, when
    each message first went out, so a step writes only its new messages."""
    text = json.dumps({**body, "messages": _HOLE}, ensure_ascii=False)
    return text.replace(_HOLE_JSON, "[" + ", ".join(messages) + "]", 1).encode()


def _text(content: object) -> str:
    """The text of a content value of any protocol (a string, null, or parts/blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(p.get("text") if isinstance(p, dict) and "text" in p else
                             p.get("content") if isinstance(p, dict) else p) for p in content)
    return json.dumps(content, ensure_ascii=False)

