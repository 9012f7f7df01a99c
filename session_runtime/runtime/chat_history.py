"""A chat client's history against a stored conversation (core.py's part
for it): a stateless request's step on the conversation it continues
(`step`: its history checked against the stored one, continuation.py, or made
the conversation's with `replace`; a protocol's own reasoning policy or
cleared tool uses applied from this step on), the client's history adopted
into a conversation, the canonical history rederived from the trace, and the
prompt a request would render.

It is handed what it uses when built: the conversations and their locks, the
request checks, the templates, the materializer (a replaced history cancels
its pending branch), whether the backend wants the client's own assistant
messages (upstream mode), and the runtime's two step kinds (a user message,
tool results), run with the conversation's lock held."""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional, Sequence

from session_runtime import continuation, importer, tool_clearing
from session_runtime.conversation import Conversation
from session_runtime.runtime.conversation_table import ConversationTable
from session_runtime.policies import ReasoningPolicy
from session_runtime.runtime.request_checks import RequestChecks
from session_runtime.step import Step
from session_runtime.templates import Message, Template
from session_runtime.tool_clearing import Cleared


class ChatHistory:
    def __init__(self, table: ConversationTable, checks: RequestChecks, template: Callable[[str], Template],
                 materializer, wants_transcript: bool, message_step: Callable[..., Step],
                 results_step: Callable[..., Step]):
        self.table, self.checks, self.template, self.materializer = table, checks, template, materializer
        self.wants_transcript = wants_transcript
        self.message_step, self.results_step = message_step, results_step

    def adopt(self, conv: Conversation, system: Optional[str], tools: Sequence[dict],
               raw_messages: Sequence[dict]) -> bool:
        """Make the conversation's system prompt, tools and history the client's
        (OpenAI messages without the system one), in memory only: the caller
        persists it with the step that follows. Keeps it as is when it already
        says the same; returns whether it replaced it. `system` and `tools` were
        checked by the caller (RequestChecks.prompt). Raises InvalidRequest."""
        self.checks.fits("messages", "".join(map(importer.message_text, raw_messages)))
        tpl = self.template(conv.template)
        messages = importer.client_messages(tpl, raw_messages)
        if self.wants_transcript:  # upstream mode: the client's assistant messages go back as sent
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

    def step(self, conversation_id: str, request: continuation.ChatInput, *, replace: bool = False,
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
                self.adopt(conv, request.system, tools, request.history)
            else:
                continuation.check(conv, self.template(conv.template), request)
            repolicy = policy is not None and policy != conv.policy
            reclear = cleared is not None and cleared != conv.cleared
            if repolicy or reclear:
                before = before or conv.snapshot()
                conv.policy, conv.cleared = policy or conv.policy, conv.cleared if cleared is None else cleared
                self.rederive(conv)
                if reclear:  # past the first block that changed, the history was never computed as it now reads
                    conv.known = dataclasses.replace(conv.known, diverged="tool_uses_cleared")
            conv.rules = rules  # read by this step's commit only
            if retry_key is not None:  # stored with the step: a retry reaching another process finds it
                conv.retry_key = retry_key
            try:
                if content is not None:
                    step = self.message_step(conv, content, forced=forced, **options)
                else:
                    step = self.results_step(conv, request.tool_results(), forced=forced, **options)
            except BaseException:
                if before is not None:  # nothing of the replaced history was stored: put it back in memory
                    conv.__dict__.update(before.__dict__)
                raise
            finally:
                conv.rules = None
            if on_commit is not None:
                on_commit(conv, step)
            return step

    def rederive(self, conv: Conversation) -> None:
        """Rebuild the canonical history from the trace, which kept every
        turn's reasoning and every tool result, under the conversation's policy
        and cleared tool uses, in memory (the step that follows persists it):
        the next prompt keeps what they keep; past the first difference the
        chain no longer matches and the step prefills from there (the
        rendering forks)."""
        conv.history = self.derived_history(conv, conv.cleared)

    def derived_history(self, conv: Conversation, cleared: Cleared) -> list[Message]:
        """The canonical history of `conv`'s trace under its policy, with `cleared` tool uses cleared."""
        tpl = self.template(conv.template)
        keep = conv.kept_reasoning()
        return [m if m.role != "assistant" or keep(m.turn) or not m.reasoning else tpl.strip_reasoning(m)
                for m in tool_clearing.apply(tpl, conv.trace_messages(), cleared)]

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
                self.derived_history(conv, cleared)
            return self.template(conv.template).rendered_length(conv.system, conv.tools, history + new, keep, True)
