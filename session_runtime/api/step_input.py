"""The one way a protocol route's request reaches the runtime: each route
(Chat Completions, Messages, Responses) turns its wire request into a
`StepInput` and hands it to `StepAnswers.answer`, which runs it as a step of
its conversation (named, created, or inferred from a stateless client's
history: session_runtime/stateless.py) and gives back the `Step`, or a stream
of the step's typed events rendered by the route's own `Render`
(api/streaming.py). No route builds another route's request or reads another
route's answer.

Messages are in the runtime's message shape (continuation.py: OpenAI chat's
roles, `reasoning_content`, `tool_calls` with JSON arguments, `tool` results),
the shape protocols/convert.py converts every protocol's history to.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from fastapi.responses import StreamingResponse

from session_runtime import continuation
from session_runtime.api.settings import Caller
from session_runtime.api.streaming import Render, sse_step
from session_runtime.constrained.spec import NONE, OutputConstraint
from session_runtime.errors import ConversationBusy, ConversationNotFound, InvalidRequest
from session_runtime.policies import ReasoningPolicy
from session_runtime.step import Step
from session_runtime.tool_clearing import Cleared

CONVERSATION_HEADER = "x-session-runtime-conversation"
# The runtime's finish reasons in chat's vocabulary, which canonical replies use too.
FINISH = {"forced": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}


class UnknownConversation(ConversationNotFound):
    def __str__(self) -> str:
        return (f"conversation {self.args[0]!r} not found; to create it with this id, send \"create\": true "
                "with conversation_id")


@dataclass(frozen=True)
class Stateless:
    """How a protocol route's stateless request is to be inferred: the route
    (its protocol), the harness's session key, the reasoning policy the
    protocol's own controls set for this request (None: the conversation's),
    the tool uses its prompt shows cleared (None: as the conversation's), and
    which of the protocol's rules decided them (the step's `rules`)."""

    protocol: str = "openai-chat"
    session_key: Optional[str] = None
    policy: Optional[ReasoningPolicy] = None
    cleared: Optional[Cleared] = None
    rules: Optional[dict] = None


@dataclass(frozen=True)
class StepInput:
    """A request for one step, whatever protocol it came in."""

    messages: list  # the runtime's message shape (module docstring), system first if any
    tools: Optional[list] = None  # None: the request sent none
    max_tokens: Optional[int] = None  # the client's cap; None: what remains of the context
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    conversation_id: Optional[str] = None  # None: a stateless client's request
    create: bool = False  # with conversation_id: create it when it does not exist
    replace: bool = False  # with conversation_id: the client's history replaces the stored one
    policy: Optional[str] = None  # a conversation this request creates: its reasoning policy
    stateless: Stateless = Stateless()
    constraint: OutputConstraint = NONE  # a forced call, an answer schema, stop sequences (constrained/wire.py)
    top_k: int = 0  # 0: every token


def sampling_figures(max_tokens: object, temperature: object, top_p: object, names: dict[str, str]) -> dict:
    """A request's sampling figures as StepInput takes them, checked as the
    chat route's request model checks them, in its words (`names`: each
    figure's name in the request). Raises InvalidRequest naming the field."""
    def refuse(figure: str, why: str) -> None:
        raise InvalidRequest(f"{names[figure]}: Input should be {why}", param=names[figure])

    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            refuse("max_tokens", "a valid integer")
        if max_tokens < 0:
            refuse("max_tokens", "greater than or equal to 0")
    if temperature is not None:
        if not number(temperature):
            refuse("temperature", "a valid number")
        if temperature < 0:
            refuse("temperature", "greater than or equal to 0")
    if top_p is not None:
        if not number(top_p):
            refuse("top_p", "a valid number")
        if top_p <= 0:
            refuse("top_p", "greater than 0")
        if top_p > 1:
            refuse("top_p", "less than or equal to 1")
    return {"max_tokens": max_tokens, "temperature": 0.0 if temperature is None else float(temperature),
            "top_p": 1.0 if top_p is None else float(top_p)}


class StepAnswers:
    """Answers StepInputs on the runtime; `record_step(accounting, ms)` and
    `record_error()` are the metrics' (api/app.py)."""

    def __init__(self, runtime, record_step: Callable, record_error: Callable[[], None]):
        self.runtime, self.record_step, self.record_error = runtime, record_step, record_error

    def answer(self, inp: StepInput, caller: Caller, cancel, render: Render) -> Union[Step, StreamingResponse]:
        """The step (`inp.stream` false), or its stream rendered by `render`
        with the conversation named in CONVERSATION_HEADER. Errors before the
        step starts (bad input, an unknown conversation, ...) raise, and change nothing."""
        runtime = self.runtime
        # No cap: what remains of the context (at most --max-tokens-limit). Refused before anything changes.
        max_tokens = runtime.max_tokens(inp.max_tokens, default=None)
        request = continuation.split(inp.messages, inp.tools)
        options = {"max_tokens": max_tokens, "temperature": inp.temperature, "top_p": inp.top_p, "top_k": inp.top_k,
                   "seed": inp.seed,
                   "logprobs": inp.logprobs, "top_logprobs": inp.top_logprobs, "constraint": inp.constraint}
        prepared = None
        if inp.conversation_id:
            cid, created = self._conversation(inp, request, caller)
        else:
            if inp.create or inp.replace:
                raise InvalidRequest("create and replace need a conversation_id",
                                     param="create" if inp.create else "replace")
            s = inp.stateless
            policy = s.policy or (ReasoningPolicy(inp.policy) if inp.policy else None)
            prepared = runtime.stateless.prepare(request, tenant=caller.tenant, protocol=s.protocol,
                                                 session_key=s.session_key, policy=policy, cleared=s.cleared,
                                                 rules=s.rules, options=[options, inp.stream])
            cid, created = prepared.conversation_id, False

        def run(on_token=None, step_cancel=cancel, on_prefill=None) -> Step:
            t0 = time.perf_counter()
            try:
                if prepared is not None:
                    step = runtime.stateless.run(prepared, on_token=on_token, on_prefill=on_prefill,
                                                 cancel=step_cancel, **options)
                else:
                    step = runtime.chat_step(cid, request, replace=inp.replace, on_token=on_token,
                                             on_prefill=on_prefill, cancel=step_cancel, **options)
            except Exception:  # counted where it is answered: the error handlers, or a late stream event
                if created:  # forget what this request created, unless another request has stepped it since
                    with contextlib.suppress(ConversationNotFound):
                        runtime.delete_conversation(cid, if_version=0)
                raise
            self.record_step(step.accounting, (time.perf_counter() - t0) * 1e3)
            return step

        if not inp.stream:
            return run()
        tpl = runtime.template(runtime.get(cid).template)
        return StreamingResponse(sse_step(run, tpl, cancel=cancel, on_late_error=self.record_error, render=render,
                                          stop=inp.constraint.stop),
                                 media_type="text/event-stream", headers={CONVERSATION_HEADER: cid})

    def _conversation(self, inp: StepInput, request: continuation.ChatInput, caller: Caller) -> tuple[str, bool]:
        """(conversation id, created by this request?). A new conversation holds the
        client's system prompt, tools and earlier messages from the start. Raises
        ConversationNotFound for an unknown `conversation_id` without `create` (or
        another tenant's), ConversationBusy when `create` names another tenant's."""
        runtime = self.runtime
        options = dict(tools=request.tools, policy=inp.policy, tenant=caller.tenant, history=request.history)
        cid = inp.conversation_id
        try:
            conv = runtime.get(cid)
        except ConversationNotFound:
            if not inp.create:
                raise UnknownConversation(cid) from None
            try:
                return runtime.create_conversation(request.system, conversation_id=cid, **options), True
            except ConversationBusy:  # another request created it first: continue it as any other request
                conv = runtime.get(cid)
        if not caller.may_see(conv.tenant):
            if inp.create:
                raise ConversationBusy(f"conversation_id {cid!r} is taken; choose another")
            raise UnknownConversation(cid)
        return cid, False
