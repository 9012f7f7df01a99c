"""Stateless requests as conversations: a harness's request (its whole history,
no conversation named) served as a step of the conversation it continues.

`StatelessSteps.prepare` finds that conversation (inference.py: the history's
digest, a retry's, the harness's session key) or creates one holding the
request's history, before any answer starts (so the answer can name it);
`run` steps it through `Runtime.chat_step`, which checks the history against
the stored one under the conversation's lock. A guess the check refuses (a
race moved the conversation on, an edited or compacted history) falls back to
the next candidate and finally to a new conversation: a request that matches
nothing never changes a stored conversation. With a store, a history this
process's index does not know is looked up by its digest in the store too
(a restart, or another process of a fleet, which the request is relayed to). A retry of the last step (the
same history and input again) replays that step's answer, never a second turn.

Inferred conversations expire after `--session-idle-ttl-s` without a request,
and a tenant at its cap loses its least recently used inferred conversation
rather than having stateless traffic refused.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from session_runtime import continuation
from session_runtime.errors import ConversationNotFound, HistoryConflict, TooManyConversations
from session_runtime.inference import Match, RequestKeys, SessionIndex, request_keys
from session_runtime.policies import ReasoningPolicy
from session_runtime.step import Step
from session_runtime.tool_clearing import Cleared

_SWEEP_EVERY_S = 5.0


@dataclass
class Prepared:
    """A stateless request, matched: the conversation it runs on and how it was found."""

    request: continuation.ChatInput
    tenant: Optional[str]
    protocol: str
    session_key: Optional[str]
    policy: Optional[ReasoningPolicy]
    cleared: Optional[Cleared]
    rules: Optional[dict]
    keys: RequestKeys
    conversation_id: str
    match: Optional[Match]  # None: created for this request (deleted again if its first step fails)
    tried: set


class StatelessSteps:
    """The runtime's stateless way in. Built with the runtime it steps through
    (its public methods only: chat_step and its hooks, create_conversation,
    delete_conversation, serve_here, template, store), the request checks,
    the config and the index it keeps."""

    def __init__(self, runtime, index: SessionIndex, checks, config):
        self.runtime, self.checks, self.config = runtime, checks, config
        self.index = index
        self._swept = 0.0
        # Conversations created for a request whose step has not committed yet, by
        # its input digest: the same request racing in meanwhile (a harness's
        # retry) waits for that step and replays it instead of creating another.
        self._creating: dict[bytes, str] = {}
        self._creating_lock = threading.Lock()

    def prepare(self, request: continuation.ChatInput, *, tenant: Optional[str], protocol: str,
                session_key: Optional[str] = None, policy: Optional[ReasoningPolicy] = None,
                cleared: Optional[Cleared] = None, rules: Optional[dict] = None,
                options: object = None) -> Prepared:
        """Find or create the request's conversation; `policy`, `cleared` and
        `rules` as `Runtime.chat_step` takes them; `options`: what else
        the request asks (sampling, streaming), which a retry repeats too. Raises InvalidRequest for
        a system prompt or tools the runtime refuses, TooManyConversations when
        the tenant's cap is full of explicit conversations."""
        self._sweep()
        tools = self.checks.prompt(request.system, request.tools)
        keys = request_keys(tenant, self.config.template, request.system, tools, request.history, request.new,
                            [options, policy and (policy.name, policy.keep_last_k),
                             cleared and (sorted(cleared.results), sorted(cleared.inputs))])
        p = Prepared(request, tenant, protocol, session_key, policy, cleared, rules, keys, "", None, set())
        self._choose(p)
        return p

    def run(self, p: Prepared, **options) -> Step:
        """The request's step on its conversation (options as send_message's).
        Raises the step's errors; a conversation created for it is deleted
        again when its step fails."""
        try:
            return self._run(p, options)
        finally:
            with self._creating_lock:
                if self._creating.get(p.keys.input) == p.conversation_id:
                    del self._creating[p.keys.input]

    def _run(self, p: Prepared, options: dict) -> Step:
        for _ in range(4):
            try:
                step = self.runtime.chat_step(
                    p.conversation_id, p.request, policy=p.policy, cleared=p.cleared, rules=p.rules,
                    replay=self._replay(p), retry_key=p.keys.input,
                    on_commit=lambda conv, step: self.index.record(conv, p.protocol, p.keys, p.session_key, step),
                    **options)
                self.index.matched[p.match.how if p.match else "new"] += 1
                return step
            except (HistoryConflict, ConversationNotFound):
                if p.match is None:
                    raise  # our own new conversation: nothing else can have moved it
            except BaseException:
                if p.match is None:
                    with contextlib.suppress(ConversationNotFound):
                        self.runtime.delete_conversation(p.conversation_id, if_version=0)
                raise
            self._choose(p)  # the guess was wrong, or raced: the next candidate, else a new conversation
        raise AssertionError("a new conversation's step neither ran nor failed")

    def _choose(self, p: Prepared) -> None:
        """The next conversation to try: this process's index, a racing
        creation, then the store's tails (another process's, or one this
        process stored before a restart). In a fleet, one another live process
        owns is not stepped here: OwnedElsewhere relays the request there."""
        match = self.index.find(p.keys, p.tenant, p.session_key)
        if match is None:
            with self._creating_lock:
                racing = self._creating.get(p.keys.input)
            match = Match(racing, "retry") if racing is not None else None
        store = self.runtime.store
        if match is None and store is not None:
            # The digests carry the tenant: no other tenant's conversation has this input or tail. A
            # retry first: its history is the tail the conversation had before the step it repeats.
            cid = store.find_retry(p.keys.input)
            match = Match(cid, "retry") if cid is not None else None
            if match is None or (match.conversation_id, match.how) in p.tried:
                cid = store.find_tail(p.keys.history)
                match = Match(cid, "history") if cid is not None else None
        if match is not None and (match.conversation_id, match.how) not in p.tried:
            self.runtime.serve_here(match.conversation_id)
            p.conversation_id, p.match = match.conversation_id, match
        else:
            p.conversation_id, p.match = self._create(p), None
        p.tried.add((p.conversation_id, p.match.how if p.match else "new"))

    def _replay(self, p: Prepared) -> Optional[Callable]:
        # A new conversation too: the same request racing in may have taken its lock first and run the step.
        if p.match is not None and p.match.how != "retry":
            return None

        def replay(conv) -> Optional[Step]:
            step = self.index.retry_step(conv.id, p.keys, conv.version)
            if step is None and p.match is not None and conv.retry_key == p.keys.input:
                step = self._stored_step(conv)  # run by a process gone since: its step as stored
            return step
        return replay

    def _stored_step(self, conv) -> Optional[Step]:
        """The conversation's last step as the store keeps it (a retry's answer
        where no process remembers it); None where it has none."""
        entry = conv.trace[-1] if conv.trace else None
        if entry is None or entry.message.role != "assistant" or not conv.turns or not conv.turns[-1].steps:
            return None
        m, tpl = entry.message, self.runtime.template(conv.template)
        parsed = tpl.parse_output(m.output_ids, f"{conv.call_prefix}_{m.turn}_{entry.step}")
        return Step(conversation_id=conv.id, turn=m.turn, step=entry.step or 0, reasoning=m.reasoning,
                    content=m.content, tool_calls=[c.as_dict() for c in m.tool_calls],
                    finish_reason="tool_calls" if m.tool_calls else entry.finish_reason or "stop",
                    output_ids=list(m.output_ids), logprobs=None, accounting=conv.turns[-1].steps[-1],
                    reasoning_tokens=parsed.reasoning_tokens(len(m.output_ids)))

    def _create(self, p: Prepared) -> str:
        policy = p.policy or ReasoningPolicy(self.config.policy)
        r = p.request
        for _ in range(8):
            try:
                cid = self.runtime.create_conversation(
                    r.system, tools=r.tools, tenant=p.tenant, policy=policy.name, keep_last_k=policy.keep_last_k,
                    history=r.history, inferred=p.protocol)
                with self._creating_lock:
                    self._creating.setdefault(p.keys.input, cid)
                return cid
            except TooManyConversations:
                victim = self.index.least_recent_of(p.tenant)
                if victim is None:
                    raise
                self._delete(victim)
        raise TooManyConversations("the tenant's conversations could not be made room for")

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < _SWEEP_EVERY_S:
            return
        self._swept = now
        for cid in self.index.expired():
            self._delete(cid)

    def _delete(self, cid: str) -> None:
        with contextlib.suppress(ConversationNotFound):
            self.runtime.delete_conversation(cid)
        self.index.forget(cid)
