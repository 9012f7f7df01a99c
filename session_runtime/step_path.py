"""The step and turn-close path of the runtime: render, run one backend
request, commit the step in every layer, and at a turn's close apply the
reasoning policy (the fork, the canonical branch, the shadows of keep and
drop for the next turn's counterfactual). A mixin of Runtime (`runtime.py`),
which holds the conversations, their locks and the store; a step runs with
its conversation's lock held."""

from __future__ import annotations

import dataclasses
import operator
import time
from itertools import compress
from typing import Callable, Optional

from radix_ext.tree import ProbeResult
from session_runtime.auto_policy import AutoChoice, TurnShape
from session_runtime.constrained import grammar
from session_runtime.constrained.spec import NONE as NO_CONSTRAINT, OutputConstraint, cut_at_stop
from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.policies import MaterializeSettings
from session_runtime.backends.base import Cancellation, ChainState, StepRequest, StepResult, Transcript
from session_runtime.errors import BackendUnavailable, InvalidRequest, ShuttingDown, storage_failure
from session_runtime.sampling import SamplingParams
from session_runtime.step import Step
from session_runtime.templates import Message, Template, ToolCall
from session_runtime.templates.base import keeping_starts
from session_runtime import turns as turn_rules
from session_runtime.uncached import Known, attribute
from session_runtime.proxy.prefix import OutboundPrefix
from session_runtime.request_checks import _utf8


class StepPath:
    """Mixin of Runtime: one step, its commit and its turn's close."""

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
              cancel: Optional[Cancellation] = None, on_prefill: Optional[Callable[[int, int], None]] = None,
              constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
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
            return self._run_step(conv, new, turn, sampling, forced, on_token, cancel, on_prefill, constraint)
        finally:
            with self._lock:
                self._inflight.discard(cancel)

    def _run_step(self, conv: Conversation, new: list[Message], turn: int, sampling: SamplingParams,
                  forced: Optional[dict], on_token: Optional[Callable[[int], None]], cancel: Cancellation,
                  on_prefill: Optional[Callable[[int, int], None]] = None,
                  constraint: OutputConstraint = NO_CONSTRAINT) -> Step:
        tpl = self.template(conv.template)
        forced_ids = self._forced_ids(tpl, forced)
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
            redrop = self._auto_redrop(conv, tpl) if first and conv.policy.name == "auto" else None
            keep = redrop.keep if redrop is not None else conv.kept_reasoning()
            history = redrop.history if redrop is not None else conv.history
            rendered = tpl.render(conv.system, conv.tools, history + new, keep, True)
            # A budget past the context's end is what remains of it (the answer then ends on length).
            remaining = max(self.context_limit - len(rendered.ids), 0)
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
                self._apply_redrop(conv, redrop, new[0].turn)
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
            self._persist(conv)  # before the response returns
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
                history_len: int, known: Known, redrop: Optional["_Redrop"] = None) -> Step:
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
            acc = self._close_turn(conv, tpl, ns, record, prompt + list(result.output), acc, result.chain)
            if conv.policy.holds_chain:
                self.offload.idle_started(conv.id)
            finish = result.finish_reason
        record.steps.append(acc)
        return Step(
            conversation_id=conv.id, turn=turn, step=step_index, reasoning=reasoning,
            content=parsed.content, tool_calls=[c.as_dict() for c in parsed.tool_calls],
            finish_reason=finish, output_ids=result.output, logprobs=result.logprobs, accounting=acc,
            top_logprobs=result.top_logprobs, stop_sequence=result.stop_sequence,
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
        settings, dropped = conv.materialize, None
        if conv.policy.name == "auto" and self.backend.holds_kv:
            reported = chain  # the step's own report of the pool, where it made one
            choice, settings, dropped = self._auto_close(conv, tpl, record, generated, acc,
                                                         (lambda: reported.free_fraction) if reported is not None
                                                         else self.backend.free_fraction)
            record.auto = choice.as_dict()
            if choice.choice != "drop":
                dropped = None  # kept: the canonical history is another
        conv.history, canonical = dropped or _canonical(tpl, conv, conv.kept_reasoning())
        fork = turn_rules.common_prefix(generated, canonical)
        record.fork_tokens = fork
        acc = dataclasses.replace(acc, active_context_length=len(canonical))
        materialize: Optional[bool] = None  # this turn's real decision, when one is made
        conv.canonical_kind = "generated" if fork >= len(generated) else "prefix"  # generated: nothing dropped
        forks = fork < len(generated) and conv.policy.holds_chain
        record.dropped_tokens = len(generated) - fork
        record.branch_freed = forks and conv.policy.may_materialize
        if conv.policy.holds_chain:
            # A's KV was computed after R: past the fork nothing may be reused. Hold
            # the shared prefix (its partial page copied); a dropping policy frees
            # the generated branch at once, where no other chain or step holds it.
            try:
                closed = self.backend.close_turn(conv.id, ns, canonical[:fork] if forks else None,
                                                 free_branch=conv.policy.may_materialize,
                                                 idle_ttl_s=self.config.idle_ttl_s)
                # None: the close is sent after this step answers; the chain will hold the fork
                # (the step's report held the whole sequence).
                chain = closed if closed is not None or chain is None else dataclasses.replace(
                    chain, tokens=min(fork, chain.tokens) if forks else chain.tokens)
            except BackendUnavailable as exc:
                # The chain's worker went down after the step finished: there is no
                # chain to hold there now. The step stands; the conversation moves
                # and its next step prefills its history elsewhere (recomputed).
                chain, forks = ChainState(0, 0, 0.0), False
                record.materialize = f"skipped: the chain's worker is gone ({exc})"
        free = (lambda: chain.free_fraction) if chain is not None else self.backend.free_fraction
        if forks and conv.policy.may_materialize:
            materialize, why = settings.decide(
                reasoning_tokens=len(generated) - fork - (len(canonical) - fork),
                answer_tokens=_dropped_answer(tpl, conv, len(canonical)) - fork,
                free_fraction=free,
                idle=self.materializer.waiting_users == 0,  # this request has already left
            )
            record.materialize = ("scheduled: " if materialize else "skipped: ") + why
            if materialize:
                self.materializer.submit(conv.id, canonical, ns)
        # Under drop the shadow of drop is this very chain: the same decision, not a second one.
        # A sampled step's last token was never fed (it has no KV), under either policy.
        unfed = min(max(0, len(generated) - len(conv.chain_tokens)), len(conv.trace[-1].message.output_ids))
        if not self.backend.wants_transcript:  # upstream mode has no KV to weigh keep against drop by
            self._shadow(conv, tpl, record, materialize if conv.policy.name == "drop" else None, unfed, free)
        return self._chain_bytes(conv, acc, chain)

    def _auto_redrop(self, conv: Conversation, tpl: Template) -> Optional["_Redrop"]:
        """Policy auto at a turn's first step: the closed turns it kept whose
        reasoning the chain no longer holds (evicted, a restart, a dead worker,
        released), since it would be prefilled again anyway, dropped where the
        model says it pays (it does whenever there is reasoning to drop).
        None: nothing to drop. Changes no layer."""
        closed = conv.closed_turns
        kept = [t.index for t in conv.turns if t.closed and t.auto is not None and t.auto["choice"] == "keep"]
        if not kept or not self.backend.holds_kv:
            return None
        try:
            device = self.backend.peek_chain_tokens(conv.id)
            bpt = self.backend.bytes_per_token
            held = (device or 0) + (self.backend.host_bytes(conv.id) // bpt if bpt else 0)
        except BackendUnavailable:
            return None
        if device is None:  # not known yet: nothing is decided on a guess
            return None
        keep, history = conv.kept_reasoning(), conv.history
        first_output = {}
        for i, m in enumerate(history):
            if m.role == "assistant":
                first_output.setdefault(m.turn, i)
        gone = tuple(t for t in kept if t in first_output and
                     tpl.rendered_length(conv.system, conv.tools, history[:first_output[t]], keep, True) >= held)
        if not gone:
            return None
        after = conv.policy.kept_turns(closed, frozenset(kept) - set(gone))
        dropped = _without_reasoning(tpl, history, after)
        now = tpl.rendered_length(conv.system, conv.tools, history, keep, False)
        then = tpl.rendered_length(conv.system, conv.tools, dropped, after, False)
        computed = _computed_tokens(conv.turns[-1].steps if conv.turns else [])
        rest = self.auto.outlooks.outlook(conv.id, conv.tenant, closed + 1, 0.0, computed)
        # The turn is here: its tokens and the rest's see the reasoning kept, and it is prefilled now.
        outlook = dataclasses.replace(rest, next_turn=1.0, turns=1.0 + rest.turns)
        choice = self.auto.choose(TurnShape(reasoning=now - then, tail=0, fork=min(held, then)), outlook,
                                  reason="not_resident")
        return _Redrop(gone, dropped, after, choice) if choice.choice == "drop" else None

    def _apply_redrop(self, conv: Conversation, redrop: "_Redrop", turn: int) -> None:
        """Write what `_auto_redrop` found into the history and each turn's record
        (replaced, so that the store writes them again)."""
        conv.history = redrop.history
        for k, record in enumerate(conv.turns):
            if record.index in redrop.turns:
                conv.turns[k] = dataclasses.replace(record, auto={**redrop.choice.as_dict(), "decided_at_turn": turn,
                                                                  "kept_at_close": record.auto})

    def _auto_close(self, conv: Conversation, tpl: Template, record: TurnRecord, generated: list[int], acc,
                    free_fraction) -> tuple[AutoChoice, "MaterializeSettings", tuple[list[Message], list[int]]]:
        """Policy auto at the close of `record`'s turn (closed, no choice yet, so
        dropped by `kept_reasoning`): the turn's shape from the history
        rendered with its reasoning dropped against the generated sequence,
        the conversation's outlook, the choice; and the materialize settings
        with the outlook's chance of another turn, which decide the canonical
        branch if it drops (and whether dropping would build it, for the
        choice); and the canonical history and ids with it dropped. Changes
        no layer."""
        dropped = _canonical(tpl, conv, conv.kept_reasoning())
        drop_ids = dropped[1]
        fork = turn_rules.common_prefix(generated, drop_ids)
        shape = TurnShape(reasoning=len(generated) - len(drop_ids), tail=len(drop_ids) - fork, fork=fork)
        computed = _computed_tokens([*record.steps, acc])
        outlooks = self.auto.outlooks
        outlooks.turn_closed(conv.id, conv.tenant, computed)
        if shape.reasoning <= 0:  # nothing to drop: the pool is not asked
            return self.auto.choose(shape, outlooks.outlook(conv.id, conv.tenant, conv.closed_turns, 1.0, computed)), \
                conv.materialize, dropped
        free = free_fraction()
        floor = conv.materialize.min_free_fraction
        resident = 1.0 if floor <= 0 else min(1.0, free / floor)
        outlook = outlooks.outlook(conv.id, conv.tenant, conv.closed_turns, resident, computed)
        settings = dataclasses.replace(conv.materialize, continue_probability=outlook.next_turn)
        builds, _ = settings.decide(reasoning_tokens=shape.reasoning, answer_tokens=shape.tail, free_fraction=free,
                                    idle=self.materializer.waiting_users == 0)
        return self.auto.choose(shape, outlook, float(builds)), settings, dropped

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
        trace = conv.trace_messages()
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

    def stop_steps(self) -> None:
        """Shutting down: steps in flight stop at their next token and fail (503),
        changing nothing, and no new step starts."""
        with self._lock:
            self._stopping = True
            for cancel in list(self._inflight):
                cancel.cancel(ShuttingDown("the server is shutting down"))


@dataclasses.dataclass(frozen=True)
class _Redrop:
    """Kept turns policy auto drops at a turn's first step, the chain being gone."""

    turns: tuple[int, ...]
    history: list[Message]  # the canonical history with their reasoning dropped
    keep: object  # the KeepReasoning after it
    choice: AutoChoice

    def rule(self) -> dict:
        return {"rule": "auto", "reason": self.choice.reason, "dropped_turns": list(self.turns),
                "reasoning_tokens": self.choice.shape.reasoning}


def _canonical(tpl: Template, conv: Conversation, keep) -> tuple[list[Message], list[int]]:
    """The conversation's history with the reasoning `keep` does not keep
    stripped, and its rendering without a generation prompt."""
    history = _without_reasoning(tpl, conv.history, keep)
    return history, tpl.render(conv.system, conv.tools, history, keep, False).ids


def _dropped_answer(tpl: Template, conv: Conversation, canonical: int) -> int:
    """Where the closed turns whose reasoning is dropped end in the canonical
    sequence (`canonical` tokens long): before the first closed turn that keeps
    its reasoning (keep_last_k's), whose tokens past the fork are no answer of
    a dropped turn, though they are prefilled again with it."""
    keep = conv.kept_reasoning()
    kept = next((i for i, m in enumerate(conv.history) if m.role == "user" and keep(m.turn)), None)
    if kept is None:
        return canonical
    return tpl.rendered_length(conv.system, conv.tools, conv.history[:kept], keep, False)


def _computed_tokens(steps) -> int:
    """Tokens some steps computed: their prefill and their output."""
    return sum((s.uncached_prefill_tokens or 0) + s.output_tokens for s in steps)


_reasoning = operator.attrgetter("reasoning")


def _without_reasoning(tpl: Template, history: list[Message], keep) -> list[Message]:
    """`history` with the reasoning of the assistant messages whose turns do not
    keep it stripped. Only messages that still carry reasoning before the first
    kept turn are looked at, found in C: at a turn's close that is the closed
    turn's (and, over a client's history, whatever it brought), not the whole
    conversation."""
    end = keeping_starts(keep, history)
    carrying = compress(range(len(history) if end is None else end), map(_reasoning, history))
    out = list(history)
    for i in carrying:
        m = history[i]
        if m.role == "assistant" and not keep(m.turn):
            out[i] = tpl.strip_reasoning(m)
    return out
