"""The step path of the runtime: render, run one backend request, commit the
step in every layer, and at a turn's close hand the turn to its close
(turn_close.py: the reasoning policy, the fork, the canonical branch, the
shadows of keep and drop for the next turn's counterfactual). The runtime's
part for it (core.py builds it with what it uses: the backend, the
materializer, the offload manager, the request checks, the turn's close, the
store, the auto policy's outlooks, the templates and the cache namespace); a
step runs with its conversation's lock held (conversation_table.py), and this
part owns the steps in flight, which a shutdown stops."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional

from radix_ext.tree import ProbeResult
from session_runtime.constrained import grammar
from session_runtime.constrained.spec import NONE as NO_CONSTRAINT, OutputConstraint, cut_at_stop
from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.backends.base import Cancellation, StepRequest, StepResult, Transcript
from session_runtime.errors import ShuttingDown, storage_failure
from session_runtime.sampling import SamplingParams
from session_runtime.step import Step
from session_runtime.templates import Message, Template
from session_runtime import turns as turn_rules
from session_runtime.uncached import Known, attribute
from session_runtime.proxy.prefix import OutboundPrefix
from session_runtime.runtime.turn_close import Redrop, apply_redrop


class StepPath:
    def __init__(self, config, backend, materializer, offload, checks, turn_close, storage, auto,
                 template: Callable[[str], Template], namespace: Callable[[Conversation], object]):
        self.config, self.backend, self.materializer, self.offload = config, backend, materializer, offload
        self.checks, self.turn_close, self.storage, self.auto = checks, turn_close, storage, auto
        self.template, self.namespace = template, namespace
        self._lock = threading.Lock()
        self._inflight: set[Cancellation] = set()  # steps running now: a shutdown cancels them
        self._stopping = False

    def message(self, conv: Conversation, content: str, **options) -> Step:
        """A user message opening the conversation's next turn, and the turn's
        first step (`options`: Runtime.send_message's)."""
        return self._sampled(conv, self.checks.user_message(conv, content), **options)

    def results(self, conv: Conversation, results, **options) -> Step:
        """Tool results answering every pending call, and the turn's next step."""
        return self._sampled(conv, self.checks.result_messages(conv, results), **options)

    def _sampled(self, conv: Conversation, new: list[Message], *, max_tokens=None, temperature=0.0, seed=None,
                 logprobs=False, forced=None, on_token=None, cancel=None, top_p=1.0, top_k=0, top_logprobs=0,
                 on_prefill=None, constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        sampling = self.checks.sampling(conv, max_tokens, temperature, seed, logprobs, top_p, top_logprobs,
                                        constraint, top_k)
        return self.run(conv, new, new[0].turn, sampling, forced, on_token, cancel, on_prefill, constraint)

    def run(self, conv: Conversation, new: list[Message], turn: int, sampling: SamplingParams,
              forced: Optional[dict], on_token: Optional[Callable[[int], None]] = None,
              cancel: Optional[Cancellation] = None, on_prefill: Optional[Callable[[int, int], None]] = None,
              constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        """One step; `cancel` (or the request deadline) stops it between tokens,
        and then it changes nothing."""
        self.checks.budget(conv.tenant)
        cancel = cancel or Cancellation()
        if cancel.deadline is None and self.config.request_deadline_s:
            cancel.deadline = time.monotonic() + self.config.request_deadline_s
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self._inflight.add(cancel)
        try:
            return self._run_step(conv, new, turn, sampling, forced, on_token, cancel, on_prefill, constraint)
        finally:
            with self._lock:
                self._inflight.discard(cancel)

    def _run_step(self, conv: Conversation, new: list[Message], turn: int, sampling: SamplingParams,
                  forced: Optional[dict], on_token: Optional[Callable[[int], None]], cancel: Cancellation,
                  on_prefill: Optional[Callable[[int, int], None]] = None,
                  constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        tpl = self.template(conv.template)
        forced_ids = self.checks.forced_ids(tpl, forced)
        ns = self.namespace(conv)
        first = new[0].role == "user"
        self.materializer.user_enter()
        wait = self.offload.wait_ended(conv.id)  # the tool wait is over: no demotion now
        worker = conv.worker
        job = None
        try:
            # A pending materialization is cancelled, a running one joined.
            job = self.materializer.claim(conv.id)
            if job is not None and job.state == "done" and conv.turns:
                conv.turns[-1].canonical_built(job.prefill_tokens)
                conv.canonical_kind = "canonical"
            # Policy auto: kept reasoning the chain no longer holds is dropped at no cost in reuse.
            redrop = self.turn_close.redrop(conv, tpl) if first and conv.policy.name == "auto" else None
            keep = redrop.keep if redrop is not None else conv.kept_reasoning()
            history = redrop.history if redrop is not None else conv.history
            rendered = tpl.render(conv.system, conv.tools, history + new, keep, True)
            # A budget past the context's end is what remains of it (the answer then ends on length).
            remaining = max(self.checks.context_limit - len(rendered.ids), 0)
            if sampling.max_tokens > remaining and forced is None:
                sampling = dataclasses.replace(sampling, max_tokens=remaining)
            if constraint.needs_grammar and forced is None:
                sampling = self._grammar(conv, tpl, rendered, sampling, constraint)
            history_len = tpl.rendered_length(conv.system, conv.tools, history, keep, False) if history else 0
            # No KV here in upstream mode: nothing local to weigh keep against drop by.
            probe_prompts = self._counterfactual_prompts(conv, tpl, new) \
                if first and not self.backend.wants_transcript else None
            in_step = probe_prompts is not None and self.backend.route(conv.id).probes_in_step
            counterfactual = None if probe_prompts is None or in_step else \
                self._counterfactual(conv, probe_prompts, self.backend.route(conv.id).probe_many(ns, probe_prompts))
            self.backend.reload(conv.id, ns, rendered.ids)  # host tier -> device, outside the engine lock
            transcript = None
            if self.backend.wants_transcript:  # upstream mode: the provider answers from the messages
                if conv.outbound is None:
                    conv.outbound = OutboundPrefix()
                transcript = Transcript(conv.system, conv.tools, conv.trace_messages() + new, tpl,
                                        conv.outbound)
            result = self.backend.step(
                StepRequest(
                    owner=conv.id, prompt=rendered.ids, namespace=ns, sampling=sampling,
                    forced=forced_ids, history_len=history_len,
                    cache_output=conv.policy.caches_output, hold_chain=conv.policy.holds_chain,
                    on_token=on_token, on_prefill=on_prefill, cancel=cancel, transcript=transcript,
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
        before = conv.snapshot()  # what a failed commit or save goes back to

        def undo() -> None:
            # Not committed, not done: the conversation is as before the step (a
            # retry runs it once); its KV stays cached, and the closed turn's
            # canonical branch or tool wait, if the commit started one, is dropped.
            self.materializer.cancel(conv.id)
            self.offload.wait_ended(conv.id)
            conv.__dict__.update(before.__dict__)

        try:
            if redrop is not None:
                apply_redrop(conv, redrop, new[0].turn)
            known = self._known_before(conv, worker)
            # The system prompt and tools are history too, for the reasons (first_seen).
            before_new = history_len if conv.history else tpl.rendered_length(conv.system, conv.tools, [], keep, False)
            step = self._commit(conv, tpl, ns, new, turn, rendered.ids, result, counterfactual,
                                before_new, known, redrop)
        except BaseException:
            undo()
            raise
        conv.version += 1
        try:
            self.storage.persist(conv)  # before the response returns
        except Exception as exc:
            undo()
            raise storage_failure("the step could not be saved, so it did not happen", exc) from exc
        return step

    _RULES = ("keep", "drop")

    def _grammar(self, conv, tpl: Template, rendered, sampling: SamplingParams,
                 constraint: OutputConstraint) -> SamplingParams:
        """`sampling` with the step's grammar: the answer's structural tag, and
        where the output starts inside the reasoning block (unless the prompt
        closed it: DeepSeek's skip marker) the token that ends it and its
        budget (OutputConstraint.reasoning_budget); unchanged when nothing is
        to be constrained."""
        tag = grammar.structural_tag(tpl, conv.tools, constraint)
        budget = constraint.reasoning_budget(sampling.max_tokens)
        thinking = not rendered.spans or rendered.spans[-1].kind != "think_skip"
        end = grammar.end_think(tpl) if thinking else None
        if tag is None and (budget is None or end is None):
            return sampling
        return dataclasses.replace(sampling, grammar=tag, think_end=end, think_budget=budget if end is not None else None)

    def _counterfactual_prompts(self, conv: Conversation, tpl: Template, new: list[Message]) -> list[list[int]]:
        """This turn's prompt as keep and as drop would render it."""
        generated = conv.trace_messages() + new
        rules = (turn_rules.keep_all, turn_rules.keep_from(new[0].turn))
        return [tpl.render(conv.system, conv.tools, generated, keep, True).ids for keep in rules]

    def _counterfactual(self, conv: Conversation, prompts: list[list[int]], probes) -> dict:
        """Keep vs drop for this turn's prompt, from probes of the tree as it was before the step."""
        return {name: turn_rules.counterfactual_entry(prompt, probe, conv.shadows.get(name, ()))
                for name, prompt, probe in zip(self._RULES, prompts, probes)}

    def _known_before(self, conv: Conversation, worker: Optional[str]) -> Known:
        """What the runtime knew of the conversation's KV when the step started,
        with what happened to it since: a move to another worker, a tool wait
        under an offload policy that discards, a canonical branch built."""
        known = conv.known
        now = self.backend.worker_of(conv.id)
        if worker is not None and now is not None and now != worker:
            known = dataclasses.replace(known, lost="backend_lost")
        elif conv.protocol is not None and conv.offload is not None and conv.offload.mode == "discard":
            known = dataclasses.replace(known, lost="discarded")
        # A canonical branch holds the history as it read before tool uses were cleared from it.
        if conv.canonical_kind == "canonical" and known.diverged != "tool_uses_cleared":
            known = dataclasses.replace(known, history_computed=True)
        return known

    def _commit(self, conv, tpl, ns, new, turn, prompt, result: StepResult, counterfactual,
                history_len: int, known: Known, redrop: Optional[Redrop] = None) -> Step:
        """Record a successful step in every layer, then close the turn if it ended."""
        step_index = 0 if new[0].role == "user" else len(conv.turns[-1].steps)
        parsed = tpl.parse_output(result.output, f"{conv.call_prefix}_{turn}_{step_index}")
        if result.stop_sequence is not None:  # the text ends before it; the ids stay as generated
            parsed = cut_at_stop(parsed, result.stop_sequence)
        if result.wire is not None:  # upstream mode: the provider's message and call ids, verbatim
            parsed = dataclasses.replace(parsed, reasoning=result.wire.reasoning, content=result.wire.content,
                                         tool_calls=tuple(result.wire.calls))
        reasoning = parsed.reasoning
        assistant = Message("assistant", turn, content=parsed.content, reasoning=reasoning,
                            tool_calls=parsed.tool_calls, output_ids=tuple(result.output),
                            wire=result.wire.wire if result.wire is not None else "")
        acc = result.accounting
        if acc.uncached_prefill_tokens is not None and not self.backend.wants_transcript:
            acc = dataclasses.replace(acc, uncached=attribute(
                prompt, history_len, acc.uncached_prefill_tokens, acc.alignment_loss_tokens, known))
        if conv.rules is not None:
            acc = dataclasses.replace(acc, rules=conv.rules)
        if redrop is not None:  # the accounting names what auto dropped before this step's prompt
            acc = dataclasses.replace(acc, rules={**(acc.rules or {}), "auto": redrop.rule()})
        # What the next step will know: this sequence was computed; history past it
        # that is not the next step's input was rewritten by the policy.
        conv.known = Known(sequence=result.sequence, diverged="policy_fork",
                           kept=None if conv.policy.caches_output else len(prompt))
        if new[0].role == "user":
            self.auto.outlooks.turn_opened(conv.id, conv.tenant, conv.closed_turns)
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
            acc = self.turn_close.close(conv, tpl, ns, record, prompt + list(result.output), acc, result.chain)
            if conv.policy.holds_chain:
                self.offload.idle_started(conv.id)
            finish = result.finish_reason
        record.steps.append(acc)
        return Step(
            conversation_id=conv.id, turn=turn, step=step_index, reasoning=reasoning,
            content=parsed.content, tool_calls=[c.as_dict() for c in parsed.tool_calls],
            finish_reason=finish, output_ids=result.output, logprobs=result.logprobs, accounting=acc,
            top_logprobs=result.top_logprobs, stop_sequence=result.stop_sequence,
            reasoning_tokens=parsed.reasoning_tokens(len(result.output)),
        )

    def stop(self) -> None:
        """Shutting down: steps in flight stop at their next token and fail (503),
        changing nothing, and no new step starts."""
        with self._lock:
            self._stopping = True
            for cancel in list(self._inflight):
                cancel.cancel(ShuttingDown("the server is shutting down"))
