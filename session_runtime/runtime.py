"""The runtime's Python API: conversations, turns and tool chains over a
backend (the embedded engine, or SGLang's server). The HTTP layer and the
examples call only this class.

    rt = Runtime(RuntimeConfig(model="tiny"))
    cid = rt.create_conversation(system="You are terse.", policy="drop")
    step = rt.send_message(cid, "Hello", max_tokens=8)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import secrets
import threading
from typing import Callable, Iterator, Optional, Sequence

from radix_ext.tree import Namespace
from session_runtime.config import RuntimeConfig
from session_runtime.conversation import Conversation
from session_runtime.backends import create_backend
from session_runtime.backends.base import Cancellation
from session_runtime.errors import (BackendUnavailable, storage_failure, TooManyConversations, ConversationBusy, ConversationNotFound, InvalidRequest,
                                   ToolCallConflict, WorkerNotFound)
from session_runtime.auto_policy import AutoPolicy
from session_runtime.materializer import Materializer
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.step import Step
from session_runtime.tool_clearing import Cleared
from session_runtime.registry import Conversations
from session_runtime.constrained.spec import NONE as NO_CONSTRAINT, OutputConstraint
from session_runtime.templates import Message, Template, auto_template, build_template
from session_runtime.tokenizer import load_tokenizer
from session_runtime import continuation, importer, tool_clearing
from session_runtime.inference import SessionIndex
from session_runtime.stateless import StatelessSteps
from session_runtime.inspection import RuntimeInspection
from session_runtime.persistence import Persistence
from session_runtime.request_checks import RequestChecks, _utf8
from session_runtime.step_path import StepPath
from session_runtime.turn_close import TurnClose

log = logging.getLogger(__name__)


class Runtime(Persistence, StepPath, RequestChecks, RuntimeInspection):
    """Holds conversations, the backend and the materializer. Thread-safe: steps
    of one conversation are serialized; the embedded engine serializes all
    steps, SGLang batches steps of different conversations."""

    def __init__(self, config: Optional[RuntimeConfig] = None, *, background: bool = True):
        self.config = config or RuntimeConfig()
        self.tokenizer = load_tokenizer(self.config.model, self.config.template)
        if self.config.template == "auto":
            self.config = self.config.replace(template=auto_template(self.config.model, self.tokenizer))
        self.backend = create_backend(self.config, self.tokenizer)
        # The embedded engine's internals, for its own tests and benchmarks.
        self.engine = self.backend if getattr(self.backend, "is_embedded_engine", False) else None
        self.materializer = Materializer(self.backend, background=background)
        self.materializer.on_done = self._materialized
        self.offload = self.backend.make_offload(background, idle_ttl_s=self.config.idle_ttl_s)
        if not self.backend.supports_offload:
            self.config = self.config.replace(offload="never")
        self.model_id = self.config.model_id or self.config.model
        self.conversations = Conversations(self._load)
        self._templates: dict[str, Template] = {}
        self._conv_locks: dict[str, threading.Lock] = {}
        self._sizes: dict[str, int] = {}  # bytes each conversation takes as stored (estimated without a store)
        self._tenant_bytes: dict[Optional[str], int] = {}
        self._lock = threading.RLock()
        self._inflight: set[Cancellation] = set()  # steps running now: shutdown cancels them
        self._stopping = False
        self.sessions = SessionIndex(self.config.session_idle_ttl_s)  # inferred conversations (inference.py)
        self.stateless = StatelessSteps(self, self.sessions)  # stateless requests' way in (stateless.py)
        c = self.config
        self.auto = AutoPolicy(c.cost_model or c.model, c.cost_dtype, c.prefill_chunk, c.kv_price)
        if c.policy == "auto":
            self.auto.cost  # fail at start, not on the first turn's close
        self.turn_close = TurnClose(self.backend, self.materializer, self.auto, c.idle_ttl_s)  # turn_close.py
        self.template(self.config.template)  # fail at start, not on the first request
        self._open_store()

    def _materialized(self, job) -> None:
        """A canonical branch is in the tree: record it on the turn that closed.
        Runs on the materializer's thread; the conversation's next step waits
        for the job, so nothing else writes these fields meanwhile."""
        with self._lock:
            conv = self.conversations.get(job.owner)
        if conv is not None and conv.turns:
            conv.turns[-1].canonical_built(job.prefill_tokens)
            conv.canonical_kind = "canonical"
            self._persist(conv)

    def drain_worker(self, worker: str) -> list[str]:
        """Many workers: nothing more is placed on `worker`, and its conversations
        move to the others now (their next steps prefill there). Returns the
        conversations moved. Raises WorkerNotFound."""
        if worker not in getattr(self.backend, "workers", {}):
            raise WorkerNotFound(worker)
        moved = self.backend.drain(worker)
        for cid in moved:
            with self._lock:
                conv, lock = self.conversations.get(cid), self._conv_locks.get(cid)
            if conv is not None and lock is not None and lock.acquire(blocking=False):
                try:  # a step under way persists the new placement itself (and sees the move)
                    if self.conversations.peek(cid) is not conv:
                        continue  # it left memory meanwhile: its next use reads the placement back
                    conv.known = dataclasses.replace(conv.known, lost="backend_lost")
                    self._persist(conv)
                finally:
                    lock.release()
        return moved

    def _place(self, conv: Conversation, worker: Optional[str] = None, stateless: bool = False) -> None:
        """Many workers: the conversation's worker (a restored one while it is
        usable; a stateless one's, none while sglang-router routes its steps).
        None is up: placed at its first step instead."""
        try:
            conv.worker = self.backend.place(conv.id, worker, stateless=stateless)
        except BackendUnavailable:
            conv.worker = worker

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names clients may ask for the model by (--served-model-name), the first first."""
        return self.config.served_model_names or (self.model_id,)

    def served_name(self, requested: str) -> Optional[str]:
        """The served name `requested` means (a `[1m]` suffix ignored), or None."""
        name = requested[:-4] if requested.endswith("[1m]") else requested
        return name if name in self.served_names else None

    # ----- conversations ------------------------------------------------------

    def template(self, name: str) -> Template:
        with self._lock:
            if name not in self._templates:
                try:
                    self._templates[name] = build_template(name, self.tokenizer, self.config.model)
                except InvalidRequest as exc:  # a special token the tokenizer lacks
                    raise InvalidRequest(f"template {name!r} does not fit tokenizer {self.tokenizer.name}: {exc}")
            return self._templates[name]

    def namespace(self, conv: Conversation) -> Namespace:
        """Cache namespace: model, tokenizer and template; the tenant as salt."""
        return Namespace(
            extra_key=f"{self.model_id}|{self.tokenizer.digest}|{conv.template}",
            cache_salt=conv.tenant,
        )

    def create_conversation(
        self,
        system: Optional[str] = None,
        *,
        tools: Optional[Sequence[dict]] = None,
        tenant: Optional[str] = None,
        policy: Optional[str] = None,
        keep_last_k: int = 1,
        materialize: str = "auto",
        template: Optional[str] = None,
        continue_probability: float = 0.8,
        offload: Optional[str] = None,
        ttl_s: float = 2.0,
        conversation_id: Optional[str] = None,
        stateless: bool = False,
        history: Sequence[dict] = (),
        inferred: Optional[str] = None,
    ) -> str:
        """Create a conversation; returns its id. `history`: a chat client's
        earlier messages (OpenAI's, without the system one), adopted before the
        conversation is visible to any other request. `stateless`: a throw-away
        one for a single request (many SGLang workers: sglang-router routes its
        steps). `inferred`: the protocol of the stateless client whose history
        it was inferred from (stateless.py); its tool-call ids are then random,
        in that protocol's form. Raises InvalidRequest, or ConversationBusy when
        `conversation_id` is taken."""
        tools = self._check_prompt(system, tools)
        _utf8("tenant", tenant or "")
        self._check_budget(tenant or None)
        template = template or self.config.template
        self.template(template)
        if not self.backend.holds_kv:
            materialize = "never"  # no KV here: a canonical branch would be a provider request for nothing
        if offload not in (None, "never") and not self.backend.supports_offload:
            raise InvalidRequest(f"offload {offload!r} needs a host tier; the {self.backend.name} backend "
                                 "has none: use offload 'never'")
        if conversation_id is not None and (not isinstance(conversation_id, str) or not 0 < len(conversation_id) <= 128):
            raise InvalidRequest("conversation_id must be a string of 1 to 128 characters")
        if (policy or self.config.policy) == "auto" and self.backend.holds_kv:
            self.auto.cost  # the model's shape prices its turns: InvalidRequest where none is known
        conv = Conversation(
            id=conversation_id or self._new_id(), system=system or None, tools=tools,
            tenant=tenant or None, template=template,
            policy=ReasoningPolicy(policy or self.config.policy, keep_last_k),
            materialize=MaterializeSettings(materialize, continue_probability=continue_probability),
            offload=OffloadSettings(offload or self.config.offload, ttl_s=ttl_s),
            inferred=inferred,
            call_prefix=("toolu_" if inferred == "anthropic" else "call_") + secrets.token_hex(12) if inferred
            else "call",
        )
        if history:
            self._adopt(conv, conv.system, conv.tools, history)
            conv.version = 0
        limit = self.config.max_conversations_per_tenant
        with self._lock:
            if conv.id in self.conversations:
                raise ConversationBusy(f"conversation {conv.id!r} already exists")
            if limit and self.conversations.count_of(conv.tenant) >= limit:
                raise TooManyConversations(f"the tenant has {limit} conversations, the most this server keeps "
                                           "(--max-conversations-per-tenant): delete some first")
            self.conversations.add(conv)
            self._conv_locks[conv.id] = threading.Lock()
        self._place(conv, stateless=stateless)
        try:
            self._persist(conv)
        except Exception as exc:  # not saved, not created
            with self._lock:
                self.conversations.pop(conv.id, None)
                self._conv_locks.pop(conv.id, None)
            self.backend.release(conv.id)
            raise storage_failure("the conversation could not be saved, so it was not created", exc) from exc
        self._evict_idle()
        return conv.id

    def _adopt(self, conv: Conversation, system: Optional[str], tools: Sequence[dict],
               raw_messages: Sequence[dict]) -> bool:
        """Make the conversation's system prompt, tools and history the client's
        (OpenAI messages without the system one), in memory only: the caller
        persists it with the step that follows. Keeps it as is when it already
        says the same; returns whether it replaced it. `system` and `tools` were
        checked by the caller (_check_prompt). Raises InvalidRequest."""
        self._fits("messages", "".join(map(importer.message_text, raw_messages)))
        tpl = self.template(conv.template)
        messages = importer.client_messages(tpl, raw_messages)
        if self.backend.wants_transcript:  # upstream mode: the client's assistant messages go back as sent
            messages = importer.with_chat_wire(messages, raw_messages)
        if (conv.system, conv.tools) == (system, tools) and \
                continuation.first_difference(conv.trace_messages(), messages) is None:
            return False
        self.materializer.cancel(conv.id)
        conv.system, conv.tools = system, tools
        computed = conv.chain_tokens
        importer.adopt(conv, tpl, messages)
        conv.cleared = Cleared()  # the client's history, as it sent it
        # What differs from the sequence computed before is the client's history, not ours.
        conv.known = dataclasses.replace(conv.known, sequence=computed, history_computed=False,
                                         diverged="history_replaced" if computed else "first_seen")
        conv.version += 1
        return True

    def chat_step(self, conversation_id: str, request: continuation.ChatInput, *, replace: bool = False,
                  forced: Optional[dict] = None, policy: Optional[ReasoningPolicy] = None,
                  cleared: Optional[Cleared] = None, rules: Optional[dict] = None,
                  replay: Optional[Callable[[Conversation], Optional[Step]]] = None,
                  on_commit: Optional[Callable[[Conversation, Step], None]] = None,
                  retry_key: Optional[bytes] = None, **options) -> Step:
        """A stateless chat client's request on a stored conversation: check that
        its history continues the conversation (continuation.py), or with
        `replace` make the client's history the conversation's, then run the new
        input as a step (`options` as send_message's). Check, step and commit
        hold the conversation's lock, so concurrent requests run one after the
        other and each sees what the previous one stored.

        Under the lock, first: `replay` may give a step already answered (a
        client's retry of the last step), returned as it was (its tokens sent to
        `on_token` again) with nothing run or changed; `policy`, when it differs
        from the conversation's, becomes its reasoning policy from this step on
        (the protocol's own control, such as Anthropic's clear_thinking);
        `cleared`, when it differs from the conversation's, the tool uses its
        prompt shows cleared from this step on (tool_clearing.py: the history
        is rederived from the trace, and the prompt forks at the first block
        that changed); `rules`: which of the protocol's rules decided these,
        kept in the step's accounting; after the step commits, `on_commit(conv, step)`.

        Raises HistoryConflict (409) for another history, ConversationBusy when
        a user message comes while tool calls are pending, ToolCallConflict and
        the step's errors; on any error the conversation is as it was, in memory
        and in the store."""
        content = request.user_content
        if content is not None:
            self._check_message(content)
        with self._locked(conversation_id) as conv:
            answered = replay(conv) if replay is not None else None
            if answered is not None:
                if options.get("on_prefill"):
                    acc = answered.accounting
                    options["on_prefill"](acc.prompt_tokens, (acc.cached_input_tokens or 0) + acc.host_loaded_tokens)
                for token in answered.output_ids if options.get("on_token") else ():
                    options["on_token"](token)
                return answered
            before = copy.deepcopy(conv) if replace else None
            if replace:
                tools = self._check_prompt(request.system, request.tools if request.tools is not None else conv.tools)
                self._adopt(conv, request.system, tools, request.history)
            else:
                continuation.check(conv, self.template(conv.template), request)
            repolicy = policy is not None and policy != conv.policy
            reclear = cleared is not None and cleared != conv.cleared
            if repolicy or reclear:
                before = before or conv.snapshot()
                conv.policy, conv.cleared = policy or conv.policy, conv.cleared if cleared is None else cleared
                self._rederive(conv)
                if reclear:  # past the first block that changed, the history was never computed as it now reads
                    conv.known = dataclasses.replace(conv.known, diverged="tool_uses_cleared")
            conv.rules = rules  # read by this step's commit only
            if retry_key is not None:  # stored with the step: a retry reaching another process finds it
                conv.retry_key = retry_key
            try:
                if content is not None:
                    step = self._message_step(conv, content, forced=forced, **options)
                else:
                    step = self._results_step(conv, request.tool_results(), forced=forced, **options)
            except BaseException:
                if before is not None:  # nothing of the replaced history was stored: put it back in memory
                    conv.__dict__.update(before.__dict__)
                raise
            finally:
                conv.rules = None
            if on_commit is not None:
                on_commit(conv, step)
            return step

    def _rederive(self, conv: Conversation) -> None:
        """Rebuild the canonical history from the trace, which kept every
        turn's reasoning and every tool result, under the conversation's policy
        and cleared tool uses, in memory (the step that follows persists it):
        the next prompt keeps what they keep; past the first difference the
        chain no longer matches and the step prefills from there (the
        rendering forks)."""
        conv.history = self._derived_history(conv, conv.cleared)

    def _derived_history(self, conv: Conversation, cleared: Cleared) -> list[Message]:
        """The canonical history of `conv`'s trace under its policy, with `cleared` tool uses cleared."""
        tpl = self.template(conv.template)
        keep = conv.kept_reasoning()
        return [m if m.role != "assistant" or keep(m.turn) or not m.reasoning else tpl.strip_reasoning(m)
                for m in tool_clearing.apply(tpl, conv.trace_messages(), cleared)]

    def get(self, conversation_id: str) -> Conversation:
        """Raises ConversationNotFound."""
        with self._lock:
            resident = self.conversations.resident
            conv = self.conversations.get(conversation_id)
            loaded = self.conversations.resident > resident
        if conv is None:
            raise ConversationNotFound(conversation_id)
        if loaded:
            self._evict_idle()
        return conv

    @contextlib.contextmanager
    def _locked(self, conversation_id: str) -> Iterator[Conversation]:
        """Hold the conversation's lock; raises ConversationNotFound if it is gone
        by the time the lock is ours (a delete that ran first wins)."""
        while True:
            conv = self.get(conversation_id)
            with self._lock:
                lock = self._conv_locks.get(conv.id)
            if lock is None:
                raise ConversationNotFound(conversation_id)
            with lock:
                with self._lock:
                    current = self.conversations.peek(conv.id)
                if current is conv:
                    yield conv
                    return
                if conversation_id not in self.conversations:
                    raise ConversationNotFound(conversation_id)
            # It left memory while we waited (_evict_idle): read it back.

    def delete_conversation(self, conversation_id: str, if_version: Optional[int] = None) -> bool:
        """Forget the conversation and unlock its chain (its KV becomes evictable).
        With `if_version`, only while nothing has committed since that version
        (an undo never deletes another request's turn). Returns whether it deleted."""
        with self._locked(conversation_id) as conv:
            if if_version is not None and conv.version != if_version:
                return False
            if self.store is not None:  # first: a delete that cannot be saved does not happen
                try:
                    self.store.delete(conv.id)
                except Exception as exc:
                    raise storage_failure("the delete could not be saved, so it did not happen", exc) from exc
            self._unstored.delete(conv.id)
            self.sessions.forget(conv.id)
            if conv.turns:  # how long conversations last: policy auto expects the rest of the others by it
                self.auto.outlooks.ended(conv.id, conv.tenant, conv.closed_turns)
            self.materializer.cancel(conv.id)
            self.offload.forget(conv.id)
            with self._lock:
                self.conversations.pop(conv.id, None)
                self._conv_locks.pop(conv.id, None)
            self._sized(conv, None)
            self.backend.release(conv.id)
            if self.fleet is not None:
                self.fleet.forget(conv.id)
            return True

    # ----- steps ----------------------------------------------------------------

    def send_message(
        self,
        conversation_id: str,
        content: str,
        *,
        max_tokens: Optional[int] = None,
        temperature: float = 0.0,
        seed: Optional[int] = None,
        logprobs: bool = False,
        forced: Optional[dict] = None,
        on_token: Optional[Callable[[int], None]] = None,
        on_prefill: Optional[Callable[[int, int], None]] = None,
        cancel: Optional[Cancellation] = None,
        top_p: float = 1.0,
        top_k: int = 0,
        top_logprobs: int = 0,
        constraint: OutputConstraint = NO_CONSTRAINT,
    ) -> Step:
        """Open a turn with a user message and run its first step (at most
        `max_tokens`: None is 64, or the server's limit if lower).

        `forced` = {reasoning?, content?, tool_calls?} appends that output instead of
        sampling (replay). Raises ConversationNotFound, ConversationBusy (tool calls
        pending), InvalidRequest, ContextTooLong or PoolExhausted; on error nothing
        changes.
        """
        self._check_message(content)
        with self._locked(conversation_id) as conv:
            return self._message_step(conv, content, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, on_prefill=on_prefill,
                                      cancel=cancel,
                                      top_p=top_p, top_k=top_k, top_logprobs=top_logprobs, constraint=constraint)

    def _message_step(self, conv: Conversation, content: str, *, max_tokens=None, temperature=0.0, seed=None,
                      logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0, top_k=0, top_logprobs=0,
                      on_prefill=None, constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        """send_message's step, the conversation's lock held."""
        new = self._user_message(conv, content)
        return self._step(conv, new, new[0].turn,
                          self._sampling(conv, max_tokens, temperature, seed, logprobs, top_p, top_logprobs,
                                         constraint, top_k),
                          forced, on_token, cancel, on_prefill, constraint)

    def _user_message(self, conv: Conversation, content: str) -> list[Message]:
        """The user message that opens the conversation's next turn. Raises
        ConversationBusy while tool calls are pending."""
        if conv.protocol is not None:
            pending = [c.id for c in conv.protocol.pending_calls]
            raise ConversationBusy(f"turn {conv.protocol.turn} waits for tool results: {pending}; answer them "
                                   "first")
        return [Message("user", len(conv.turns), content)]

    def send_tool_results(
        self,
        conversation_id: str,
        results: Sequence[dict],
        *,
        max_tokens: Optional[int] = None,
        temperature: float = 0.0,
        seed: Optional[int] = None,
        logprobs: bool = False,
        forced: Optional[dict] = None,
        on_token: Optional[Callable[[int], None]] = None,
        on_prefill: Optional[Callable[[int, int], None]] = None,
        cancel: Optional[Cancellation] = None,
        top_p: float = 1.0,
        top_k: int = 0,
        top_logprobs: int = 0,
        constraint: OutputConstraint = NO_CONSTRAINT,
    ) -> Step:
        """Answer every pending tool call of the open turn and run its next step.

        Raises ToolCallConflict (no call pending, unknown or repeated id),
        InvalidRequest (a pending call left unanswered), and the send_message errors.
        """
        with self._locked(conversation_id) as conv:
            return self._results_step(conv, results, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, on_prefill=on_prefill,
                                      cancel=cancel,
                                      top_p=top_p, top_k=top_k, top_logprobs=top_logprobs, constraint=constraint)

    def _results_step(self, conv: Conversation, results: Sequence[dict], *, max_tokens=None, temperature=0.0,
                      seed=None, logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0,
                      top_k=0, top_logprobs=0, on_prefill=None, constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        """send_tool_results' step, the conversation's lock held."""
        msgs = self._result_messages(conv, results)
        return self._step(conv, msgs, msgs[0].turn, self._sampling(conv, max_tokens, temperature, seed, logprobs,
                                                                    top_p, top_logprobs, constraint, top_k),
                          forced, on_token, cancel, on_prefill, constraint)

    def _result_messages(self, conv: Conversation, results: Sequence[dict]) -> list[Message]:
        """The tool messages answering every pending call, in the calls' order.
        Raises ToolCallConflict (none pending, unknown or repeated id),
        InvalidRequest (a call left unanswered, bad results), ContextTooLong."""
        if conv.protocol is None:
            raise ToolCallConflict("no tool call is pending in this conversation")
        by_id = {}
        for r in results:
            if not isinstance(r, dict) or not isinstance(r.get("tool_call_id"), str) or not isinstance(r.get("content", ""), str):
                raise InvalidRequest("each result must be {tool_call_id: str, content: str}")
            _utf8("tool result", r.get("content", ""))
            self._fits("tool result", r.get("content", ""))
            by_id.setdefault(r["tool_call_id"], []).append(r.get("content", ""))
        pending = {c.id: c for c in conv.protocol.pending_calls}
        unknown = [i for i in by_id if i not in pending]
        repeated = [i for i, v in by_id.items() if len(v) > 1]
        if unknown or repeated:
            raise ToolCallConflict(f"unknown or already answered tool calls: {unknown + repeated}")
        missing = [i for i in pending if i not in by_id]
        if missing:
            raise InvalidRequest(f"results must answer every pending call; missing {missing}")
        turn = conv.protocol.turn
        return [Message("tool", turn, content=by_id[c.id][0], tool_call_id=c.id) for c in conv.protocol.pending_calls]

    def prompt_tokens(self, conversation_id: str, request: continuation.ChatInput,
                      cleared: Optional[Cleared] = None) -> int:
        """The prompt tokens a step would render for `request`'s new input on the
        conversation (no step runs, nothing changes), with `cleared` tool
        uses cleared if given. Raises what the step would raise for that input
        before running."""
        content = request.user_content
        if content is not None:
            self._check_message(content)
        with self._locked(conversation_id) as conv:
            new = self._user_message(conv, content) if content is not None else \
                self._result_messages(conv, request.tool_results())
            keep = conv.kept_reasoning()
            history = conv.history if cleared is None or cleared == conv.cleared else \
                self._derived_history(conv, cleared)
            return self.template(conv.template).rendered_length(conv.system, conv.tools, history + new, keep, True)

    def check_integrity(self) -> None:
        """Assert pools, locks and chains add up, and every chain has a conversation."""
        self.backend.check_integrity()
        self._check_chains()

    def _check_chains(self) -> None:
        """Every chain the backend holds has a conversation here."""
        for cid in self.backend.chain_lengths():
            with self._lock:
                assert cid in self.conversations, f"chain {cid} has no conversation"

    def close(self) -> None:
        """Stop the background workers and the backend (a launched SGLang server
        with it) and close the store. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.stop_steps()
        self.materializer.close()
        self.offload.close()
        self.backend.close()
        if self.fleet is not None:
            self.fleet.close()  # the others take its conversations over at once
        if self.store is not None:
            self.store.close()
