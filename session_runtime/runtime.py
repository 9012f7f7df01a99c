"""The runtime's Python API: conversations, turns and tool chains over a
backend (the embedded engine, or SGLang's server). The HTTP layer and the
examples call only this class.

    rt = Runtime(RuntimeConfig(model="tiny"))
    cid = rt.create_conversation(system="You are terse.", policy="drop")
    step = rt.send_message(cid, "Hello", max_tokens=8)
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import secrets
from typing import Callable, Optional, Sequence

from radix_ext.tree import Namespace
from session_runtime.config import RuntimeConfig
from session_runtime.conversation import Conversation
from session_runtime.backends import create_backend
from session_runtime.backends.base import Cancellation
from session_runtime.errors import BackendUnavailable, InvalidRequest, WorkerNotFound, storage_failure
from session_runtime.auto_policy import AutoPolicy
from session_runtime.materializer import Materializer
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.step import Step
from session_runtime.tool_clearing import Cleared
from session_runtime.conversation_table import ConversationTable
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


class Runtime(StepPath, RuntimeInspection):
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
        # The conversations and their locks (conversation_table.py), read from the store at first use.
        self.table = ConversationTable(lambda cid: self.storage.load(cid))
        self.conversations = self.table.registry
        self._templates: dict[str, Template] = {}
        self._lock = self.table.lock
        self.checks = RequestChecks(self.config, self.tokenizer, self.backend, self.template, self.table.held)
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
        self.storage = Persistence(self.config, self.backend, self.table, self.sessions, self.materializer,
                                   self._place)  # persistence.py: the store, and a fleet's ownership
        self.table.on_loaded = self.storage.evict_idle

    def _materialized(self, job) -> None:
        """A canonical branch is in the tree: record it on the turn that closed.
        Runs on the materializer's thread; the conversation's next step waits
        for the job, so nothing else writes these fields meanwhile."""
        with self._lock:
            conv = self.conversations.get(job.owner)
        if conv is not None and conv.turns:
            conv.turns[-1].canonical_built(job.prefill_tokens)
            conv.canonical_kind = "canonical"
            self.storage.persist(conv)

    def drain_worker(self, worker: str) -> list[str]:
        """Many workers: nothing more is placed on `worker`, and its conversations
        move to the others now (their next steps prefill there). Returns the
        conversations moved. Raises WorkerNotFound."""
        if worker not in getattr(self.backend, "workers", {}):
            raise WorkerNotFound(worker)
        moved = self.backend.drain(worker)
        for cid in moved:
            with self._lock:
                conv, lock = self.conversations.get(cid), self.table.lock_of(cid)
            if conv is not None and lock is not None and lock.acquire(blocking=False):
                try:  # a step under way persists the new placement itself (and sees the move)
                    if self.conversations.peek(cid) is not conv:
                        continue  # it left memory meanwhile: its next use reads the placement back
                    conv.known = dataclasses.replace(conv.known, lost="backend_lost")
                    self.storage.persist(conv)
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
    def store(self):
        """The store (store.py, or store_pg.py's PostgreSQL one), or None (--no-data-dir)."""
        return self.storage.store

    @property
    def fleet(self):
        """The fleet of processes over a PostgreSQL store (fleet.py), or None."""
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
            self._adopt(conv, conv.system, conv.tools, history)
            conv.version = 0
        self.table.add(conv, self.config.max_conversations_per_tenant)
        self._place(conv, stateless=stateless)
        try:
            self.storage.persist(conv)
        except Exception as exc:  # not saved, not created
            self.table.remove(conv)
            self.backend.release(conv.id)
            raise storage_failure("the conversation could not be saved, so it was not created", exc) from exc
        self.storage.evict_idle()
        return conv.id

    def _adopt(self, conv: Conversation, system: Optional[str], tools: Sequence[dict],
               raw_messages: Sequence[dict]) -> bool:
        """Make the conversation's system prompt, tools and history the client's
        (OpenAI messages without the system one), in memory only: the caller
        persists it with the step that follows. Keeps it as is when it already
        says the same; returns whether it replaced it. `system` and `tools` were
        checked by the caller (RequestChecks.prompt). Raises InvalidRequest."""
        self.checks.fits("messages", "".join(map(importer.message_text, raw_messages)))
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
            self.checks.message(content)
        with self.table.locked(conversation_id) as conv:
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
                tools = self.checks.prompt(request.system, request.tools if request.tools is not None else conv.tools)
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
            return self._message_step(conv, content, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, on_prefill=on_prefill,
                                      cancel=cancel,
                                      top_p=top_p, top_k=top_k, top_logprobs=top_logprobs, constraint=constraint)

    def _message_step(self, conv: Conversation, content: str, *, max_tokens=None, temperature=0.0, seed=None,
                      logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0, top_k=0, top_logprobs=0,
                      on_prefill=None, constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        """send_message's step, the conversation's lock held."""
        new = self.checks.user_message(conv, content)
        return self._step(conv, new, new[0].turn,
                          self.checks.sampling(conv, max_tokens, temperature, seed, logprobs, top_p, top_logprobs,
                                         constraint, top_k),
                          forced, on_token, cancel, on_prefill, constraint)

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
            return self._results_step(conv, results, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, on_prefill=on_prefill,
                                      cancel=cancel,
                                      top_p=top_p, top_k=top_k, top_logprobs=top_logprobs, constraint=constraint)

    def _results_step(self, conv: Conversation, results: Sequence[dict], *, max_tokens=None, temperature=0.0,
                      seed=None, logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0,
                      top_k=0, top_logprobs=0, on_prefill=None, constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        """send_tool_results' step, the conversation's lock held."""
        msgs = self.checks.result_messages(conv, results)
        return self._step(conv, msgs, msgs[0].turn, self.checks.sampling(conv, max_tokens, temperature, seed, logprobs,
                                                                    top_p, top_logprobs, constraint, top_k),
                          forced, on_token, cancel, on_prefill, constraint)

    def prompt_tokens(self, conversation_id: str, request: continuation.ChatInput,
                      cleared: Optional[Cleared] = None) -> int:
        """The prompt tokens a step would render for `request`'s new input on the
        conversation (no step runs, nothing changes), with `cleared` tool
        uses cleared if given. Raises what the step would raise for that input
        before running."""
        content = request.user_content
        if content is not None:
            self.checks.message(content)
        with self.table.locked(conversation_id) as conv:
            new = self.checks.user_message(conv, content) if content is not None else \
                self.checks.result_messages(conv, request.tool_results())
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
