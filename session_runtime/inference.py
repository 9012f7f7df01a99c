"""Session inference: which stored conversation a stateless request continues.

Agent harnesses (Claude Code, Codex CLI, every SDK agent) send their whole
history with each request and name no conversation. Each such request is
matched here to the inferred conversation it continues, within its tenant:

- a **tail digest** per inferred conversation: its system prompt, tools and
  stored transcript as a client echoes it (roles, text, tool-call names and
  arguments; no reasoning, which clients drop, and no ids, which each protocol
  writes its own way). A request whose history before its new input has that
  digest continues the conversation;
- an **input digest** of the request that ran the conversation's last step: a
  request with the same history and new input is a retry of that step;
- the harness's **session key** (Claude Code's session id, Responses'
  `prompt_cache_key`): the conversation it last named, when neither digest
  matched (for instance tool results sent back in another order).

A digest narrows the search; the runtime still checks the history against the
stored one under the conversation's lock (continuation.check) before any step,
so a wrong guess starts a new conversation and never changes a stored one.

A conversation's tail digest is extended message by message as its trace
grows (a hash state kept per conversation), so keeping the index costs each
step only its own messages; a request's digests hash its messages once, the
same pass that parsing its body already makes.

The index also keeps each inferred conversation's last use, for the idle TTL
that deletes them (`--session-idle-ttl-s`) and for the tenant's cap, which
evicts the tenant's least recently used inferred conversation instead of
refusing stateless traffic. It lives in memory; each step also stores its
conversation's tail digest with the step (`Conversation.tail`, the store's
`inferred` table), where a restarted process, or another process of a fleet,
finds it (stateless.py) when its own index does not know the request's history.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from session_runtime.importer import text_content
from session_runtime.templates.base import Message

_SEP = b"\x1e"
# A request repeating the last step's input this soon after it is a retry (a
# harness's, after a lost answer or an error); later, the same words are a new
# session that happens to start alike, and get a conversation of their own.
RETRY_WINDOW_S = 300.0


@dataclass(frozen=True)
class RequestKeys:
    """A stateless request's digests (tenant, template, system, tools included)."""

    history: bytes  # the messages before the new input: what a conversation's tail must be
    input: bytes  # the whole request: what the last step's request was, for a retry


@dataclass(frozen=True)
class Match:
    """The conversation a request was matched to, and how."""

    conversation_id: str
    how: str  # "retry" (the last step's input again), "history" (its tail) or "session_key"


@dataclass(frozen=True)
class StoredInferred:
    """An inferred conversation as the store keeps it for the index (store/sqlite.py `inferred`)."""

    conversation_id: str
    tenant: Optional[str]
    protocol: str
    tail: bytes
    idle_s: float  # since its last write


@dataclass
class _Entry:
    tenant: Optional[str]
    protocol: str
    head: tuple  # (system, tools) the hash state was started from
    state: "hashlib._Hash"  # the tail digest's hash state after `count` trace messages
    count: int = 0
    tail: Optional[bytes] = None
    input: Optional[bytes] = None
    session_key: Optional[tuple] = None
    step: Optional[object] = None  # the last step (a Step), replayed to a retry
    version: int = -1  # the conversation's version after that step
    stepped: float = 0.0  # when that step was recorded
    used: float = field(default_factory=time.monotonic)


def _start(tenant: Optional[str], template: str, system: Optional[str], tools: Sequence[dict]) -> "hashlib._Hash":
    h = hashlib.blake2b(digest_size=20)
    head = [tenant, template, (system or "").strip(), list(tools or ())]
    h.update(json.dumps(head, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return h


def _update(h: "hashlib._Hash", role: str, content: str, calls: Sequence[tuple[str, object]]) -> None:
    item = [role, content.strip(), [[name, args] for name, args in calls]]
    h.update(_SEP + json.dumps(item, sort_keys=True, ensure_ascii=False).encode("utf-8"))


def _message(h: "hashlib._Hash", m: Message) -> None:
    _update(h, m.role, m.content, [(c.name, c.arguments) for c in m.tool_calls])


def _raw(h: "hashlib._Hash", m: dict) -> None:
    """An OpenAI chat message as the client sent it, in the same form as `_message`."""
    role = m.get("role")
    calls = []
    for c in m.get("tool_calls") or () if role == "assistant" else ():
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            continue  # unreadable: continuation.check refuses it later; the digest just misses
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        calls.append((fn.get("name"), args))
    try:
        content = text_content(m.get("content"))
    except Exception:  # an unreadable message: the check that follows refuses it in its own words
        content = repr(m.get("content"))
    _update(h, str(role), content, calls)


def request_keys(tenant: Optional[str], template: str, system: Optional[str], tools: Sequence[dict],
                 history: Sequence[dict], new: Sequence[dict], options: object = None) -> RequestKeys:
    """The digests of a stateless chat request (OpenAI messages, system apart);
    `options` (the sampling and output figures, as JSON) count toward the
    input digest only: the same messages asked for other output are no retry."""
    h = _start(tenant, template, system, tools)
    for m in history:
        _raw(h, m)
    before = h.digest()
    for m in new:
        _raw(h, m)
    h.update(_SEP + json.dumps(options, sort_keys=True, default=str).encode("utf-8"))
    return RequestKeys(before, h.digest())


class SessionIndex:
    """Inferred conversations by tail digest, last input and session key, with
    their last use. Thread-safe; it holds ids and digests only, never a
    conversation's lock."""

    def __init__(self, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()  # least recently used first
        self._tails: dict[bytes, str] = {}
        self._inputs: dict[bytes, str] = {}
        self._keys: dict[tuple, str] = {}
        self.matched: Counter = Counter()  # served requests by how their conversation was found ("new": none)

    def __contains__(self, cid: str) -> bool:
        return cid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def protocol(self, cid: str) -> Optional[str]:
        e = self._entries.get(cid)
        return None if e is None else e.protocol

    def find(self, keys: RequestKeys, tenant: Optional[str], session_key: Optional[str]) -> Optional[Match]:
        """The conversation the request most likely continues, or None. The
        digests carry the tenant, so no other tenant's conversation is found."""
        with self._lock:
            cid = self._inputs.get(keys.input)
            if cid is not None and self._clock() - self._entries[cid].stepped <= RETRY_WINDOW_S:
                return Match(cid, "retry")
            cid = self._tails.get(keys.history)
            if cid is not None:
                return Match(cid, "history")
            cid = self._keys.get((tenant, session_key)) if session_key else None
            return None if cid is None else Match(cid, "session_key")

    def retry_step(self, cid: str, keys: RequestKeys, version: int):
        """The step a retry replays: the conversation's last one, while nothing
        has committed since it; else None."""
        with self._lock:
            e = self._entries.get(cid)
            if e is None or e.input != keys.input or e.version != version or \
                    self._clock() - e.stepped > RETRY_WINDOW_S:
                return None
            self._touch(cid, e)
            return e.step

    def tail_of(self, conv) -> bytes:
        """The tail digest of inferred conversation `conv` as it is now (under
        its lock, before its step is stored): hashes only the trace messages
        added since the last call."""
        with self._lock:
            return self._advance(conv, conv.inferred).state.digest()

    def seed(self, stored: Sequence["StoredInferred"]) -> None:
        """The stored inferred conversations found at start-up (before any
        request): known to the TTL and the tenant's cap, and by their tails;
        each one's hash state is rebuilt from its trace at its next step."""
        now = self._clock()
        with self._lock:
            for s in sorted(stored, key=lambda s: -s.idle_s):  # least recently used first
                e = _Entry(s.tenant, s.protocol, (), hashlib.blake2b(digest_size=20), count=-1, tail=s.tail)
                e.used = now - max(0.0, s.idle_s)
                self._entries[s.conversation_id] = e
                self._tails[s.tail] = s.conversation_id

    def _advance(self, conv, protocol: Optional[str]) -> _Entry:
        """The conversation's entry, its hash state over its whole trace (the lock held)."""
        e = self._entries.get(conv.id)
        head = (conv.system, id(conv.tools), len(conv.tools))
        if e is None or e.head != head or e.count > len(conv.trace) or e.count < 0:
            if e is not None:
                self._unindex(conv.id, e)
            e = _Entry(conv.tenant, protocol or "openai-chat", head,
                       _start(conv.tenant, conv.template, conv.system, conv.tools))
            self._entries[conv.id] = e
        for entry in conv.trace[e.count:]:
            _message(e.state, entry.message)
        e.count = len(conv.trace)
        return e

    def record(self, conv, protocol: str, keys: RequestKeys, session_key: Optional[str], step) -> None:
        """After a committed step of inferred conversation `conv` (under its
        lock): index its new tail, the request as its last input, and the
        session key. Hashes only the trace messages added since the last record."""
        with self._lock:
            e = self._advance(conv, protocol)
            self._unindex(conv.id, e)
            e.tail, e.input = e.state.digest(), keys.input
            e.session_key = (conv.tenant, session_key) if session_key else None
            e.step, e.version, e.stepped = step, conv.version, self._clock()
            self._tails[e.tail] = conv.id
            self._inputs[e.input] = conv.id
            if e.session_key is not None:
                self._keys[e.session_key] = conv.id
            self._touch(conv.id, e)

    def forget(self, cid: str) -> None:
        with self._lock:
            e = self._entries.pop(cid, None)
            if e is not None:
                self._unindex(cid, e)

    def expired(self) -> list[str]:
        """Inferred conversations idle past the TTL, oldest first (not forgotten yet)."""
        if not self.idle_ttl_s:
            return []
        cutoff = self._clock() - self.idle_ttl_s
        with self._lock:
            out = []
            for cid, e in self._entries.items():
                if e.used > cutoff:
                    break
                out.append(cid)
            return out

    def least_recent_of(self, tenant: Optional[str]) -> Optional[str]:
        """The tenant's least recently used inferred conversation, for its cap."""
        with self._lock:
            return next((cid for cid, e in self._entries.items() if e.tenant == tenant), None)

    def _touch(self, cid: str, e: _Entry) -> None:
        e.used = self._clock()
        self._entries.move_to_end(cid)

    def _unindex(self, cid: str, e: _Entry) -> None:
        for table, key in ((self._tails, e.tail), (self._inputs, e.input), (self._keys, e.session_key)):
            if key is not None and table.get(key) == cid:
                del table[key]
