"""The runtime's Python API: conversations, turns and tool chains over a
backend (the embedded engine, or SGLang's server). The HTTP layer and the
examples call only this class.

    rt = Runtime(RuntimeConfig(model="tiny"))
    cid = rt.create_conversation(system="You are terse.", policy="drop")
    step = rt.send_message(cid, "Hello", max_tokens=8)
"""

from __future__ import annotations

import logging
import secrets
from typing import Callable, Optional, Sequence

from radix_ext.tree import Namespace
from session_runtime.config import RuntimeConfig
from session_runtime.conversation import Conversation
from session_runtime.backends import create_backend
from session_runtime.backends.base import Cancellation
from session_runtime.errors import InvalidRequest, storage_failure
from session_runtime.auto_policy import AutoPolicy
from session_runtime.materializer import Materializer
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.step import Step
from session_runtime.tool_clearing import Cleared
from session_runtime.runtime.conversation_table import ConversationTable
from session_runtime.constrained.spec import NONE as NO_CONSTRAINT, OutputConstraint
from session_runtime.templates import Template, auto_template, build_template
from session_runtime.tokenizer import load_tokenizer
from session_runtime import continuation
from session_runtime.inference import SessionIndex
from session_runtime.runtime.stateless import StatelessSteps
from session_runtime.runtime.inspection import RuntimeInspection
from session_runtime.store.persistence import Persistence
from session_runtime.runtime.request_checks import RequestChecks, _utf8
from session_runtime.runtime.step_path import StepPath
from session_runtime.runtime.turn_close import TurnClose
from session_runtime.runtime.chat_history import ChatHistory

log = logging.getLogger("session_runtime.runtime")


class Runtime:
    """Wires its parts (this package's modules and store/persistence.py, each
    built here with what it uses) and answers for them: the public Python API.
    Thread-safe: steps of one conversation are serialized; the embedded engine
    serializes all steps, SGLang batches steps of different conversations."""

    def __init__(self, config: Optional[RuntimeConfig] = None, *, background: bool = True):
        self.config = config or RuntimeConfig()
        self.tokenizer = load_tokenizer(self.config.model, self.config.template)
        if self.config.template == "auto":
            self.config = self.config.replace(template=auto_template(self.config.model, self.tokenizer))
        self.backend = create_backend(self.config, self.tokenizer)
        # The embedded engine's internals, for its own tests and benchmarks.
        self.engine = self.backend if getattr(self.backend, "is_embedded_engine", False) else None
        self.materializer = Materializer(self.backend, background=background)
        self.offload = self.backend.make_offload(background, idle_ttl_s=self.config.idle_ttl_s)
        if not self.backend.supports_offload:
            self.config = self.config.replace(offload="never")
        self.model_id = self.config.model_id or self.config.model
        # The conversations and their locks (conversation_table.py), read from the store at first use.
        self.table = ConversationTable(lambda cid: self.storage.load(cid))
        self.conversations = self.table.registry
        self._templates: dict[str, Template] = {}
        self._lock = self.table.lock
        self.checks = RequestChecks(self.config, self.tokenizer, self.backend, self.template, self.table.held)
        self.sessions = SessionIndex(self.config.session_idle_ttl_s)  # inferred conversations (inference.py)
        c = self.config
        self.auto = AutoPolicy(c.cost_model or c.model, c.cost_dtype, c.prefill_chunk, c.kv_price)
        if c.policy == "auto":
            self.auto.cost  # fail at start, not on the first turn's close
        self.turn_close = TurnClose(self.backend, self.materializer, self.auto, c.idle_ttl_s)  # turn_close.py
        self.template(self.config.template)  # fail at start, not on the first request
        self.storage = Persistence(self.config, self.backend, self.table, self.sessions,
                                   self.materializer)  # store/persistence.py: the store, and a fleet's ownership
        self.table.on_loaded = self.storage.evict_idle
        self.materializer.on_done = self.storage.materialized
        self.views = RuntimeInspection(self.table, self.backend, self.tokenizer, self.template, self.storage,
                                       self.sessions, self.auto, self.materializer)  # inspection.py: read-only
        self.steps = StepPath(self.config, self.backend, self.materializer, self.offload, self.checks,
                              self.turn_close, self.storage, self.auto, self.template, self.namespace)
        self.stateless = StatelessSteps(self, self.sessions, self.checks, self.config)  # stateless.py: their way in
        self.chat = ChatHistory(self.table, self.checks, self.template, self.materializer,
                                self.backend.wants_transcript, self.steps.message, self.steps.results)

    def drain_worker(self, worker: str) -> list[str]:
        """Many workers: nothing more is placed on `worker`, and its conversations
        move to the others now (persistence.Persistence.drain). Raises WorkerNotFound."""
        return self.storage.drain(worker)

    @property
    def store(self):
        """The store (store/sqlite.py, or store/pg.py's PostgreSQL one), or None (--no-data-dir)."""
        return self.storage.store

    @property
    def fleet(self):
        """The fleet of processes over a PostgreSQL store (store/fleet.py), or None."""
        return self.storage.fleet

    def take(self, cid: str, claimed: bool) -> None:
        """In a fleet, a request for `cid` is served here (persistence.Persistence.take)."""
        self.storage.take(cid, claimed)

    def serve_here(self, cid: str) -> None:
        """In a fleet, before a stateless request steps `cid` (persistence.Persistence.serve_here)."""
        self.storage.serve_here(cid)

    @property
    def context_limit(self) -> int:
        """The longest sequence a step may reach (an SGLang server's may be shorter than ours)."""
        return self.checks.context_limit

    @property
    def max_tokens_limit(self) -> int:
        """The most tokens a step may generate: --max-tokens-limit, never more than the context."""
        return self.checks.max_tokens_limit

    def max_tokens(self, requested: Optional[int], default: Optional[int] = 64) -> int:
        """A request's max_tokens (request_checks.RequestChecks.max_tokens). Raises InvalidRequest."""
        return self.checks.max_tokens(requested, default)

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
        tools = self.checks.prompt(system, tools)
        _utf8("tenant", tenant or "")
        self.checks.budget(tenant or None)
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
            id=conversation_id or self.storage.new_id(), system=system or None, tools=tools,
            tenant=tenant or None, template=template,
            policy=ReasoningPolicy(policy or self.config.policy, keep_last_k),
            materialize=MaterializeSettings(materialize, continue_probability=continue_probability),
            offload=OffloadSettings(offload or self.config.offload, ttl_s=ttl_s),
            inferred=inferred,
            call_prefix=("toolu_" if inferred == "anthropic" else "call_") + secrets.token_hex(12) if inferred
            else "call",
        )
        if history:
            self.chat.adopt(conv, conv.system, conv.tools, history)
            conv.version = 0
        self.table.add(conv, self.config.max_conversations_per_tenant)
        self.storage.place(conv, stateless=stateless)
        try:
            self.storage.persist(conv)
        except Exception as exc:  # not saved, not created
            self.table.remove(conv)
            self.backend.release(conv.id)
            raise storage_failure("the conversation could not be saved, so it was not created", exc) from exc
        self.storage.evict_idle()
        return conv.id

    def chat_step(self, conversation_id: str, request: continuation.ChatInput, **options) -> Step:
        """A stateless chat client's request on a stored conversation: its
        history checked (or replaced), then its new input run as a step
        (chat_history.ChatHistory.step says what else it takes and raises)."""
        return self.chat.step(conversation_id, request, **options)

    def prompt_tokens(self, conversation_id: str, request: continuation.ChatInput,
                      cleared: Optional[Cleared] = None) -> int:
        """The prompt tokens a step would render for `request`'s new input on the
        conversation; nothing changes (chat_history.ChatHistory.prompt_tokens)."""
        return self.chat.prompt_tokens(conversation_id, request, cleared)

    def get(self, conversation_id: str) -> Conversation:
        """Raises ConversationNotFound."""
        return self.table.get(conversation_id)

    def delete_conversation(self, conversation_id: str, if_version: Optional[int] = None) -> bool:
        """Forget the conversation and unlock its chain (its KV becomes evictable).
        With `if_version`, only while nothing has committed since that version
        (an undo never deletes another request's turn). Returns whether it deleted."""
        with self.table.locked(conversation_id) as conv:
            if if_version is not None and conv.version != if_version:
                return False
            if self.store is not None:  # first: a delete that cannot be saved does not happen
                try:
                    self.store.delete(conv.id)
                except Exception as exc:
                    raise storage_failure("the delete could not be saved, so it did not happen", exc) from exc
            self.storage.unstored.delete(conv.id)
            self.sessions.forget(conv.id)
            if conv.turns:  # how long conversations last: policy auto expects the rest of the others by it
                self.auto.outlooks.ended(conv.id, conv.tenant, conv.closed_turns)
            self.materializer.cancel(conv.id)
            self.offload.forget(conv.id)
            self.table.remove(conv)
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
        self.checks.message(content)
        with self.table.locked(conversation_id) as conv:
            return self.steps.message(conv, content, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, on_prefill=on_prefill,
                                      cancel=cancel,
                                      top_p=top_p, top_k=top_k, top_logprobs=top_logprobs, constraint=constraint)

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
        with self.table.locked(conversation_id) as conv:
            return self.steps.results(conv, results, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, on_prefill=on_prefill,
                                      cancel=cancel,
                                      top_p=top_p, top_k=top_k, top_logprobs=top_logprobs, constraint=constraint)

    # ----- read-only views (inspection.py) -----------------------------------------

    def describe(self, conversation_id: str, tokens: bool = False) -> dict:
        """Trace, canonical history, per-turn accounting and the chain."""
        return self.views.describe(conversation_id, tokens)

    def list_conversations(self, tenant: Optional[str], everyone: bool = False, after: Optional[str] = None,
                           limit: int = 100) -> dict:
        """A page of conversations, by id after `after` (`{"data": [...], "has_more": bool}`)."""
        return self.views.list_conversations(tenant, everyone, after, limit)

    def chain_view(self, conversation_id: str) -> dict:
        """A conversation's chain as the tree page draws it."""
        return self.views.chain_view(conversation_id)

    def tree_snapshot(self, conversation: Optional[str] = None, worker: Optional[str] = None) -> list:
        """The tree (or a conversation's chain, or one worker's tree). Raises WorkerNotFound."""
        return self.views.tree_snapshot(conversation, worker)

    def integrity(self) -> dict:
        """The integrity check as a report: {"ok": True, ...} or {"ok": False, "error": ...}."""
        return self.views.integrity()

    def chains(self) -> dict[str, int]:
        """Tokens each conversation's chain holds in the tree."""
        return self.views.chains()

    def conversations_of(self, tenant: Optional[str]) -> set[str]:
        """Ids of the tenant's conversations (None: the default tenant's)."""
        return self.views.conversations_of(tenant)

    def metric_samples(self) -> list:
        """The runtime's and the backend's figures for /metrics."""
        return self.views.metric_samples()

    def stop_steps(self) -> None:
        """Shutting down: steps in flight stop at their next token and fail (503),
        changing nothing, and no new step starts."""
        self.steps.stop()

    def check_integrity(self) -> None:
        """Assert pools, locks and chains add up, and every chain has a conversation."""
        self.backend.check_integrity()
        self.views.check_chains()

    def close(self) -> None:
        """Stop the background workers and the backend (a launched SGLang server
        with it) and close the store. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.steps.stop()
        self.materializer.close()
        self.offload.close()
        self.backend.close()
        if self.fleet is not None:
            self.fleet.close()  # the others take its conversations over at once
        if self.store is not None:
            self.store.close()
