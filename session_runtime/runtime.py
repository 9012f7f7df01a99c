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
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from radix_ext.tree import Namespace, ProbeResult
from session_runtime.config import RuntimeConfig
from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.backends.base import Cancellation, ChainState, StepRequest, StepResult, Transcript, create_backend
from session_runtime.errors import (BackendUnavailable, TenantStorageFull, ContextTooLong, ShuttingDown, StorageUnavailable, TooManyConversations, ConversationBusy, ConversationNotFound, InvalidRequest,
                                   ToolCallConflict, WorkerNotFound)
from session_runtime.materializer import Materializer
from session_runtime.offload import OffloadManager, OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.sampling import SamplingParams
from session_runtime.step import Step
from session_runtime.store import Store, estimated_bytes as store_bytes
from session_runtime.tools import check_tools
from session_runtime.templates import Message, Template, ToolCall, auto_template, build_template
from session_runtime.tokenizer import load_tokenizer
from session_runtime import continuation, importer
from session_runtime.inspection import RuntimeInspection
from session_runtime import turns as turn_rules


class Runtime(RuntimeInspection):
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
        self.engine = self.backend if self.backend.name == "embedded" else None
        self.materializer = Materializer(self.backend, background=background)
        self.materializer.on_done = self._materialized
        self.offload = (OffloadManager(self.backend, background=background, idle_ttl_s=self.config.idle_ttl_s)
                        if self.backend.name == "embedded" else self.backend.make_offload(background))
        if not self.backend.supports_offload:
            self.config = self.config.replace(offload="never")
        self.model_id = self.config.model_id or self.config.model
        self.conversations: dict[str, Conversation] = {}
        self._templates: dict[str, Template] = {}
        self._conv_locks: dict[str, threading.Lock] = {}
        self._sizes: dict[str, int] = {}  # bytes each conversation takes as stored (estimated without a store)
        self._tenant_bytes: dict[Optional[str], int] = {}
        self._lock = threading.RLock()
        self._inflight: set[Cancellation] = set()  # steps running now: shutdown cancels them
        self._stopping = False
        self.template(self.config.template)  # fail at start, not on the first request
        self.store: Optional[Store] = None
        if self.config.data_dir:
            self.store = Store(Path(self.config.data_dir) / "conversations.sqlite3")
            for conv, size in self.store.load_all_sized():
                self.conversations[conv.id] = conv
                self._conv_locks[conv.id] = threading.Lock()
                self._sized(conv, size)
                self._place(conv, conv.worker)
        self.backend.adopt(sorted(self.conversations))  # chains of conversations it does not know are released

    def _materialized(self, job) -> None:
        """A canonical branch is in the tree: record it on the turn that closed.
        Runs on the materializer's thread; the conversation's next step waits
        for the job, so nothing else writes these fields meanwhile."""
        with self._lock:
            conv = self.conversations.get(job.owner)
        if conv is not None and conv.turns:
            conv.turns[-1].materialized_prefill_tokens = job.prefill_tokens
            conv.canonical_kind = "canonical"
            self._persist(conv)

    def _persist(self, conv: Conversation) -> None:
        conv.worker = self.backend.worker_of(conv.id) or conv.worker  # a step may have moved it
        self._sized(conv, self.store.save(conv) if self.store is not None else store_bytes(conv))

    def _sized(self, conv: Conversation, size: Optional[int]) -> None:
        """Record the conversation's stored bytes (None: it is gone) in its tenant's total."""
        with self._lock:
            old = self._sizes.pop(conv.id, 0)
            if size is not None:
                self._sizes[conv.id] = size
            self._tenant_bytes[conv.tenant] = self._tenant_bytes.get(conv.tenant, 0) - old + (size or 0)

    def _check_budget(self, tenant: Optional[str]) -> None:
        """Raises TenantStorageFull when the tenant holds its budget of stored bytes."""
        limit = self.config.max_tenant_bytes
        with self._lock:
            held = self._tenant_bytes.get(tenant, 0)
        if limit and held >= limit:
            raise TenantStorageFull(f"the tenant's conversations hold {held} bytes, the most this server keeps "
                                    f"for one ({limit}, --max-tenant-bytes): delete some first")

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
                try:  # a step under way persists the new placement itself
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
    ) -> str:
        """Create a conversation; returns its id. `history`: a chat client's
        earlier messages (OpenAI's, without the system one), adopted before the
        conversation is visible to any other request. `stateless`: a throw-away
        one for a single request (many SGLang workers: sglang-router routes its
        steps). Raises InvalidRequest, or ConversationBusy when `conversation_id`
        is taken."""
        tools = self._check_prompt(system, tools)
        _utf8("tenant", tenant or "")
        self._check_budget(tenant or None)
        template = template or self.config.template
        self.template(template)
        if self.backend.name == "upstream":
            materialize = "never"  # no KV here: a canonical branch would be a provider request for nothing
        if offload not in (None, "never") and not self.backend.supports_offload:
            raise InvalidRequest(f"offload {offload!r} needs a host tier; the {self.backend.name} backend "
                                 "has none: use offload 'never'")
        if conversation_id is not None and (not isinstance(conversation_id, str) or not 0 < len(conversation_id) <= 128):
            raise InvalidRequest("conversation_id must be a string of 1 to 128 characters")
        conv = Conversation(
            id=conversation_id or uuid.uuid4().hex[:16], system=system or None, tools=tools,
            tenant=tenant or None, template=template,
            policy=ReasoningPolicy(policy or self.config.policy, keep_last_k),
            materialize=MaterializeSettings(materialize, continue_probability=continue_probability),
            offload=OffloadSettings(offload or self.config.offload, ttl_s=ttl_s),
        )
        if history:
            self._adopt(conv, conv.system, conv.tools, history)
            conv.version = 0
        limit = self.config.max_conversations_per_tenant
        with self._lock:
            if conv.id in self.conversations:
                raise ConversationBusy(f"conversation {conv.id!r} already exists")
            if limit and sum(c.tenant == conv.tenant for c in self.conversations.values()) >= limit:
                raise TooManyConversations(f"the tenant has {limit} conversations, the most this server keeps "
                                           "(--max-conversations-per-tenant): delete some first")
            self.conversations[conv.id] = conv
            self._conv_locks[conv.id] = threading.Lock()
        self._place(conv, stateless=stateless)
        try:
            self._persist(conv)
        except Exception as exc:  # not saved, not created
            with self._lock:
                self.conversations.pop(conv.id, None)
                self._conv_locks.pop(conv.id, None)
            self.backend.release(conv.id)
            raise StorageUnavailable(f"the conversation could not be saved, so it was not created: {exc}") from exc
        return conv.id

    def _check_prompt(self, system: object, tools: object) -> list[dict]:
        """A conversation's system prompt and tools, checked before anything is
        tokenized or kept; returns the tools as a list. Raises InvalidRequest,
        ContextTooLong."""
        if system is not None and not isinstance(system, str):
            raise InvalidRequest("system must be a string")
        _utf8("system", system or "")
        tools, text = check_tools(tools, self.config.max_tools, self.config.max_tools_bytes)
        self._fits("system", system or "")
        self._fits("tools", text)
        return tools

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
                continuation.first_difference([e.message for e in conv.trace], messages) is None:
            return False
        self.materializer.cancel(conv.id)
        conv.system, conv.tools = system, tools
        importer.adopt(conv, tpl, messages)
        conv.version += 1
        return True

    def chat_step(self, conversation_id: str, request: continuation.ChatInput, *, replace: bool = False,
                  forced: Optional[dict] = None, **options) -> Step:
        """A stateless chat client's request on a stored conversation: check that
        its history continues the conversation (continuation.py), or with
        `replace` make the client's history the conversation's, then run the new
        input as a step (`options` as send_message's). Check, step and commit
        hold the conversation's lock, so concurrent requests run one after the
        other and each sees what the previous one stored.

        Raises HistoryConflict (409) for another history, ConversationBusy when
        a user message comes while tool calls are pending, ToolCallConflict and
        the step's errors; on any error the conversation is as it was, in memory
        and in the store."""
        content = request.user_content
        if content is not None:
            self._check_message(content)
        with self._locked(conversation_id) as conv:
            before = copy.deepcopy(conv) if replace else None
            if replace:
                tools = self._check_prompt(request.system, request.tools if request.tools is not None else conv.tools)
                self._adopt(conv, request.system, tools, request.history)
            else:
                continuation.check(conv, self.template(conv.template), request)
            try:
                if content is not None:
                    return self._message_step(conv, content, forced=forced, **options)
                return self._results_step(conv, request.tool_results(), forced=forced, **options)
            except BaseException:
                if before is not None:  # nothing of the replaced history was stored: put it back in memory
                    conv.__dict__.update(before.__dict__)
                raise

    def get(self, conversation_id: str) -> Conversation:
        """Raises ConversationNotFound."""
        with self._lock:
            conv = self.conversations.get(conversation_id)
        if conv is None:
            raise ConversationNotFound(conversation_id)
        return conv

    @contextlib.contextmanager
    def _locked(self, conversation_id: str) -> Iterator[Conversation]:
        """Hold the conversation's lock; raises ConversationNotFound if it is gone
        by the time the lock is ours (a delete that ran first wins)."""
        conv = self.get(conversation_id)
        with self._lock:
            lock = self._conv_locks.get(conv.id)
        if lock is None:
            raise ConversationNotFound(conversation_id)
        with lock:
            with self._lock:
                if self.conversations.get(conv.id) is not conv:
                    raise ConversationNotFound(conversation_id)
            yield conv

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
                    raise StorageUnavailable(f"the delete could not be saved, so it did not happen: {exc}") from exc
            self.materializer.cancel(conv.id)
            self.offload.forget(conv.id)
            with self._lock:
                self.conversations.pop(conv.id, None)
                self._conv_locks.pop(conv.id, None)
            self._sized(conv, None)
            self.backend.release(conv.id)
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
        cancel: Optional[Cancellation] = None,
        top_p: float = 1.0,
        top_logprobs: int = 0,
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
                                      logprobs=logprobs, forced=forced, on_token=on_token, cancel=cancel,
                                      top_p=top_p, top_logprobs=top_logprobs)

    def _check_message(self, content: object) -> None:
        """Refuse a user message before taking any lock. Raises InvalidRequest, ContextTooLong."""
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequest("message content must be a non-empty string")
        _utf8("content", content)
        self._fits("content", content)

    def _message_step(self, conv: Conversation, content: str, *, max_tokens=None, temperature=0.0, seed=None,
                      logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0, top_logprobs=0) -> Step:
        """send_message's step, the conversation's lock held."""
        new = self._user_message(conv, content)
        return self._step(conv, new, new[0].turn,
                          self._sampling(conv, max_tokens, temperature, seed, logprobs, top_p, top_logprobs),
                          forced, on_token, cancel)

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
        cancel: Optional[Cancellation] = None,
        top_p: float = 1.0,
        top_logprobs: int = 0,
    ) -> Step:
        """Answer every pending tool call of the open turn and run its next step.

        Raises ToolCallConflict (no call pending, unknown or repeated id),
        InvalidRequest (a pending call left unanswered), and the send_message errors.
        """
        with self._locked(conversation_id) as conv:
            return self._results_step(conv, results, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      logprobs=logprobs, forced=forced, on_token=on_token, cancel=cancel,
                                      top_p=top_p, top_logprobs=top_logprobs)

    def _results_step(self, conv: Conversation, results: Sequence[dict], *, max_tokens=None, temperature=0.0,
                      seed=None, logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0,
                      top_logprobs=0) -> Step:
        """send_tool_results' step, the conversation's lock held."""
        msgs = self._result_messages(conv, results)
        return self._step(conv, msgs, msgs[0].turn, self._sampling(conv, max_tokens, temperature, seed, logprobs,
                                                                    top_p, top_logprobs),
                          forced, on_token, cancel)

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

    def prompt_tokens(self, conversation_id: str, request: continuation.ChatInput) -> int:
        """The prompt tokens a step would render for `request`'s new input on the
        conversation (no step runs, nothing changes). Raises what the step
        would raise for that input before running."""
        content = request.user_content
        if content is not None:
            self._check_message(content)
        with self._locked(conversation_id) as conv:
            new = self._user_message(conv, content) if content is not None else \
                self._result_messages(conv, request.tool_results())
            keep = conv.policy.kept_turns(conv.closed_turns)
            return len(self.template(conv.template).render(conv.system, conv.tools, conv.history + new, keep,
                                                           True).ids)

    @property
    def max_tokens_limit(self) -> int:
        """The most tokens a step may generate: --max-tokens-limit, never more
        than the context (an SGLang server's may be shorter than ours)."""
        context = min(self.config.max_context, getattr(self.backend, "max_context", self.config.max_context))
        return min(self.config.max_tokens_limit or context, context)

    def max_tokens(self, requested: Optional[int], default: int = 64) -> int:
        """A request's max_tokens: `default` (at most the limit) when None.
        Raises InvalidRequest above the limit."""
        limit = self.max_tokens_limit
        if requested is None:
            return min(default, limit)
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0, got {requested!r}", param="max_tokens")
        if requested > limit:
            raise InvalidRequest(f"max_tokens {requested} is over this server's limit of {limit} "
                                 "(--max-tokens-limit, at most the context)", param="max_tokens")
        return requested

    def _fits(self, name: str, text: str) -> None:
        """Refuse (413) text too long for the context before tokenizing it whole:
        more bytes than any tokenization of the context covers is refused at
        once, and a text of fewer bytes as soon as about a context's worth of
        it has more tokens than the context (a few milliseconds), so a huge
        input costs no tokenizer time or memory."""
        limit = self.config.max_context
        if self.tokenizer.surely_more_tokens_than(text, limit):
            raise ContextTooLong(f"{name} of {len(text.encode('utf-8'))} bytes has more tokens than the context of "
                                 f"{limit}; it was not tokenized whole")

    def _sampling(self, conv, max_tokens, temperature, seed, logprobs, top_p: float = 1.0,
                  top_logprobs: int = 0) -> SamplingParams:
        if top_logprobs and self.backend.name != "embedded":
            raise InvalidRequest(f"top_logprobs is not supported on the {self.backend.name} backend yet",
                                 param="top_logprobs")
        return SamplingParams(
            max_tokens=self.max_tokens(max_tokens), temperature=temperature, seed=seed, top_p=top_p,
            top_logprobs=top_logprobs,
            stop_token_ids=self.template(conv.template).stop_token_ids, logprobs=logprobs,
        )

    def _forced_ids(self, tpl: Template, forced: Optional[dict]) -> Optional[list[int]]:
        if forced is None:
            return None
        if not isinstance(forced, dict) or set(forced) - {"reasoning", "content", "tool_calls"}:
            raise InvalidRequest("forced must be {reasoning?, content?, tool_calls?}")
        reasoning, content = forced.get("reasoning") or "", forced.get("content") or ""
        if not isinstance(reasoning, str) or not isinstance(content, str):
            raise InvalidRequest("forced reasoning and content must be strings")
        _utf8("forced reasoning", reasoning, "forced content", content)
        calls = []
        for c in forced.get("tool_calls") or ():
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("arguments", {}), dict):
                raise InvalidRequest("forced tool_calls must be [{name: str, arguments: object}]")
            calls.append(ToolCall(id="", name=c["name"], arguments=c.get("arguments", {})))
        ids = tpl.forced_ids(reasoning, content, calls)
        # Replay appends exactly what the template writes: refuse what it cannot
        # write back (a reasoning holding the end-of-thinking marker, a tool name
        # that breaks the call markup, ...), rather than store something else.
        back = tpl.parse_output(ids, "")
        if (back.reasoning.strip(), back.content.strip()) != (reasoning.strip(), content.strip()) or [
            (c.name, c.arguments) for c in back.tool_calls
        ] != [(c.name, c.arguments) for c in calls]:
            raise InvalidRequest("forced output does not survive the chat template: it would read back as "
                                 f"reasoning {back.reasoning[:60]!r}, content {back.content[:60]!r}, "
                                 f"{len(back.tool_calls)} tool calls")
        return ids

    def _step(self, conv: Conversation, new: list[Message], turn: int, sampling: SamplingParams,
              forced: Optional[dict], on_token: Optional[Callable[[int], None]] = None,
              cancel: Optional[Cancellation] = None) -> Step:
        """One step; `cancel` (or the request deadline) stops it between tokens,
        and then it changes nothing."""
        self._check_budget(conv.tenant)
        cancel = cancel or Cancellation()
        if cancel.deadline is None and self.config.request_deadline_s:
            cancel.deadline = time.monotonic() + self.config.request_deadline_s
        with self._lock:
            if getattr(self, "_closed", False) or self._stopping:
                raise ShuttingDown("the server is shutting down")
            self._inflight.add(cancel)
        try:
            return self._run_step(conv, new, turn, sampling, forced, on_token, cancel)
        finally:
            with self._lock:
                self._inflight.discard(cancel)

    def _run_step(self, conv: Conversation, new: list[Message], turn: int, sampling: SamplingParams,
                  forced: Optional[dict], on_token: Optional[Callable[[int], None]], cancel: Cancellation) -> Step:
        tpl = self.template(conv.template)
        forced_ids = self._forced_ids(tpl, forced)
        ns = self.namespace(conv)
        first = new[0].role == "user"
        self.materializer.user_enter()
        wait = self.offload.wait_ended(conv.id)  # the tool wait is over: no demotion now
        job = None
        try:
            # A pending materialization is cancelled, a running one joined.
            job = self.materializer.claim(conv.id)
            if job is not None and job.state == "done" and conv.turns:
                conv.turns[-1].materialized_prefill_tokens = job.prefill_tokens
                conv.canonical_kind = "canonical"
            keep = conv.policy.kept_turns(conv.closed_turns)
            rendered = tpl.render(conv.system, conv.tools, conv.history + new, keep, True)
            history_len = len(tpl.render(conv.system, conv.tools, conv.history, keep, False).ids) if conv.history else 0
            # No KV here in upstream mode: nothing local to weigh keep against drop by.
            probe_prompts = self._counterfactual_prompts(conv, tpl, new) \
                if first and not self.backend.wants_transcript else None
            in_step = probe_prompts is not None and self.backend.route(conv.id).probes_in_step
            counterfactual = None if probe_prompts is None or in_step else \
                self._counterfactual(conv, probe_prompts, self.backend.route(conv.id).probe_many(ns, probe_prompts))
            self.backend.reload(conv.id, ns, rendered.ids)  # host tier -> device, outside the engine lock
            transcript = None
            if self.backend.wants_transcript:  # upstream mode: the provider answers from the messages
                transcript = Transcript(conv.system, conv.tools, [e.message for e in conv.trace] + new, tpl)
            result = self.backend.step(
                StepRequest(
                    owner=conv.id, prompt=rendered.ids, namespace=ns, sampling=sampling,
                    forced=forced_ids, history_len=history_len,
                    cache_output=conv.policy.caches_output, hold_chain=conv.policy.holds_chain,
                    on_token=on_token, cancel=cancel, transcript=transcript,
                    probe_prompts=probe_prompts if in_step else (),
                )
            )
            if in_step:  # probed by the step itself, on the tree as it was before it
                probes = result.probes if result.probes is not None else [ProbeResult(0, 0)] * len(probe_prompts)
                counterfactual = self._counterfactual(conv, probe_prompts, probes)
        except BaseException:
            # A failed request changes nothing: the tool wait goes on as it was,
            # and a canonical branch this request cancelled is scheduled again.
            self.offload.wait_resumed(conv.id, wait)
            if job is not None and job.state == "cancelled":
                self.materializer.submit(job.owner, job.tokens, job.namespace)
            raise
        finally:
            self.materializer.user_exit()
        before = copy.deepcopy(conv)  # what a failed commit or save goes back to

        def undo() -> None:
            # Not committed, not done: the conversation is as before the step (a
            # retry runs it once); its KV stays cached, and the closed turn's
            # canonical branch or tool wait, if the commit started one, is dropped.
            self.materializer.cancel(conv.id)
            self.offload.wait_ended(conv.id)
            conv.__dict__.update(before.__dict__)

        try:
            step = self._commit(conv, tpl, ns, new, turn, rendered.ids, result, counterfactual)
        except BaseException:
            undo()
            raise
        conv.version += 1
        try:
            self._persist(conv)  # before the response returns
        except Exception as exc:
            undo()
            raise StorageUnavailable(f"the step could not be saved, so it did not happen: {exc}") from exc
        return step

    _RULES = ("keep", "drop")

    def _counterfactual_prompts(self, conv: Conversation, tpl: Template, new: list[Message]) -> list[list[int]]:
        """This turn's prompt as keep and as drop would render it."""
        generated = [e.message for e in conv.trace] + new
        rules = (turn_rules.keep_all, turn_rules.keep_from(new[0].turn))
        return [tpl.render(conv.system, conv.tools, generated, keep, True).ids for keep in rules]

    def _counterfactual(self, conv: Conversation, prompts: list[list[int]], probes) -> dict:
        """Keep vs drop for this turn's prompt, from probes of the tree as it was before the step."""
        return {name: turn_rules.counterfactual_entry(prompt, probe, conv.shadows.get(name, ()))
                for name, prompt, probe in zip(self._RULES, prompts, probes)}

    def _commit(self, conv, tpl, ns, new, turn, prompt, result: StepResult, counterfactual) -> Step:
        """Record a successful step in every layer, then close the turn if it ended."""
        step_index = 0 if new[0].role == "user" else len(conv.turns[-1].steps)
        parsed = tpl.parse_output(result.output, f"call_{turn}_{step_index}")
        if result.wire is not None:  # upstream mode: the provider's message and call ids, verbatim
            parsed = dataclasses.replace(parsed, reasoning=result.wire.reasoning, content=result.wire.content,
                                         tool_calls=tuple(result.wire.calls))
        reasoning = parsed.reasoning
        assistant = Message("assistant", turn, content=parsed.content, reasoning=reasoning,
                            tool_calls=parsed.tool_calls, output_ids=tuple(result.output),
                            wire=result.wire.wire if result.wire is not None else "")
        acc = result.accounting
        if new[0].role == "user":
            prev = conv.turns[-1] if conv.turns else None
            state = turn_rules.cache_state((acc.cached_input_tokens or 0) + acc.host_loaded_tokens,
                                           prev.first_prompt_tokens if prev else None, conv.canonical_kind)
            acc = dataclasses.replace(acc, cache_state=state, counterfactual=counterfactual)
            conv.turns.append(TurnRecord(index=turn, first_prompt_tokens=len(prompt), cache_state=state,
                                         counterfactual=counterfactual))
        record = conv.turns[-1]
        conv.history += [*new, assistant]
        conv.trace += [TraceEntry(m) for m in new]
        conv.trace.append(TraceEntry(assistant, step=step_index, finish_reason=result.finish_reason))
        conv.chain_tokens = result.sequence
        generated = (conv.protocol.generated_ids if conv.protocol else ()) + tuple(result.output)
        if parsed.tool_calls:
            conv.protocol = ProtocolState(turn, parsed.tool_calls, generated)
            self.offload.wait_started(conv.id, conv.offload)
            conv.canonical_kind = "generated"
            finish = "tool_calls"
        else:
            conv.protocol = None
            acc = self._close_turn(conv, tpl, ns, record, prompt + list(result.output), acc, result.chain)
            if conv.policy.holds_chain:
                self.offload.idle_started(conv.id)
            finish = result.finish_reason
        record.steps.append(acc)
        return Step(
            conversation_id=conv.id, turn=turn, step=step_index, reasoning=reasoning,
            content=parsed.content, tool_calls=[c.as_dict() for c in parsed.tool_calls],
            finish_reason=finish, output_ids=result.output, logprobs=result.logprobs, accounting=acc,
            top_logprobs=result.top_logprobs,
            reasoning_tokens=len(result.output) - len(parsed.answer_ids) - int(parsed.ended),
        )

    def _close_turn(self, conv, tpl, ns, record: TurnRecord, generated: list[int], acc,
                    chain: Optional[ChainState]):
        """Apply the reasoning policy to the closed turn: rebuild the canonical
        history, find the fork, hold the chain at the fork and mark it idle (one
        backend call), and maybe schedule the canonical branch. Returns the
        step's accounting with the real next context. `chain`: the chain as the
        step's own answer reported it, if it did."""
        record.closed = True
        self.backend.drop_host_copy(conv.id)  # the tool chain's copy will not be reloaded
        keep = conv.policy.kept_turns(conv.closed_turns)
        conv.history = [
            tpl.strip_reasoning(m)
            if m.role == "assistant" and not keep(m.turn) and m.reasoning
            else m
            for m in conv.history
        ]
        canonical = tpl.render(conv.system, conv.tools, conv.history, keep, False).ids
        fork = turn_rules.common_prefix(generated, canonical)
        record.fork_tokens = fork
        acc = dataclasses.replace(acc, active_context_length=len(canonical))
        materialize: Optional[bool] = None  # this turn's real decision, when one is made
        conv.canonical_kind = "generated" if fork >= len(generated) else "prefix"  # generated: nothing dropped
        forks = fork < len(generated) and conv.policy.holds_chain
        if conv.policy.holds_chain:
            # A's KV was computed after R: past the fork nothing may be reused. Hold
            # the shared prefix (its partial page copied); a dropping policy frees
            # the generated branch at once, where no other chain or step holds it.
            try:
                chain = self.backend.close_turn(conv.id, ns, canonical[:fork] if forks else None,
                                                free_branch=conv.policy.may_materialize,
                                                idle_ttl_s=self.config.idle_ttl_s)
            except BackendUnavailable as exc:
                # The chain's worker went down after the step finished: there is no
                # chain to hold there now. The step stands; the conversation moves
                # and its next step prefills its history elsewhere (recomputed).
                chain, forks = ChainState(0, 0, 0.0), False
                record.materialize = f"skipped: the chain's worker is gone ({exc})"
        free = (lambda: chain.free_fraction) if chain is not None else self.backend.free_fraction
        if forks and conv.policy.may_materialize:
            materialize, why = conv.materialize.decide(
                reasoning_tokens=len(generated) - fork - (len(canonical) - fork),
                answer_tokens=len(canonical) - fork,
                free_fraction=free,
                idle=self.materializer.waiting_users == 0,  # this request has already left
            )
            record.materialize = ("scheduled: " if materialize else "skipped: ") + why
            if materialize:
                self.materializer.submit(conv.id, canonical, ns)
        # Under drop the shadow of drop is this very chain: the same decision, not a second one.
        # A sampled step's last token was never fed (it has no KV), under either policy.
        unfed = min(max(0, len(generated) - len(conv.chain_tokens)), len(conv.trace[-1].message.output_ids))
        self._shadow(conv, tpl, record, materialize if conv.policy.name == "drop" else None, unfed, free)
        return self._chain_bytes(conv, acc, chain)

    def _shadow(self, conv: Conversation, tpl: Template, record: TurnRecord,
                drop_materializes: Optional[bool] = None, unfed: int = 0, free_fraction=None) -> None:
        """Set `conv.shadows`: the chains (token ids, no KV) that the keep and drop
        policies would hold now that turn `record.index` closed, had the
        conversation run under each from its first turn, so that the next turn's
        counterfactual is what that policy really pays, on every turn.

        Each policy's generated sequence of this turn is its own rendering of the
        trace before the closing output, plus that output (less its `unfed` last
        tokens, which have no KV): every turn's reasoning under keep, only this
        turn's under drop. Keep holds it whole. Drop holds
        its common prefix with drop's canonical sequence (this turn's reasoning
        dropped too), or the whole canonical sequence when drop would materialize
        the branch under the conversation's own materialize setting:
        `drop_materializes` is the real decision when the conversation runs drop;
        otherwise the same `decide` is asked with drop's figures."""
        trace = [e.message for e in conv.trace]
        *before, last = trace
        t = record.index

        def generated(keep) -> list[int]:
            ids = tpl.render(conv.system, conv.tools, before, keep, True).ids + list(last.output_ids)
            return ids[: len(ids) - unfed]

        keep_chain, drop_generated = generated(turn_rules.keep_all), generated(turn_rules.keep_from(t))
        canonical = tpl.render(conv.system, conv.tools, trace, turn_rules.keep_from(t + 1), False).ids
        fork = turn_rules.common_prefix(drop_generated, canonical)
        if drop_materializes is None and fork < len(drop_generated):
            drop_materializes, _ = conv.materialize.decide(
                reasoning_tokens=len(drop_generated) - len(canonical), answer_tokens=len(canonical) - fork,
                free_fraction=free_fraction or self.backend.free_fraction, idle=self.materializer.waiting_users == 0)
        conv.shadows = {"keep": keep_chain, "drop": canonical if drop_materializes else canonical[:fork]}

    def _chain_bytes(self, conv: Conversation, acc, chain: Optional[ChainState]):
        """The step's KV figures as the closed turn left the chain."""
        if not conv.policy.holds_chain:
            return acc  # nothing is held: the figures are what the step inserted
        if chain is None:
            chain = ChainState(self.backend.chain_tokens(conv.id), self.backend.host_bytes(conv.id), 0.0)
        return dataclasses.replace(acc, kv_device_bytes=chain.tokens * self.backend.bytes_per_token,
                                   kv_host_bytes=chain.host_bytes)

    def check_integrity(self) -> None:
        """Assert pools, locks and chains add up, and every chain has a conversation."""
        self.backend.check_integrity()
        for cid in self.backend.chain_lengths():
            with self._lock:
                assert cid in self.conversations, f"chain {cid} has no conversation"

    def stop_steps(self) -> None:
        """Shutting down: steps in flight stop at their next token and fail (503),
        changing nothing, and no new step starts."""
        with self._lock:
            self._stopping = True
            for cancel in list(self._inflight):
                cancel.cancel(ShuttingDown("the server is shutting down"))

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
        if self.store is not None:
            self.store.close()


def _utf8(*named: str) -> None:
    """Raise InvalidRequest for text that is not valid Unicode (a lone surrogate
    from a JSON escape): it could not be tokenized, stored or returned."""
    for name, text in zip(named[::2], named[1::2]):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{name} is not valid Unicode: {exc.reason} at {exc.start}") from None
