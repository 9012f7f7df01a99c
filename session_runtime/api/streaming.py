"""Server-sent events for a step: reasoning and content deltas as tokens are
decoded, then one final event with the whole step and its accounting.

The step runs on its own thread. A client that disconnects, streamed or not,
cancels it: it stops at its next token and changes nothing (`cancellable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator, Optional, Sequence, TypeVar

import anyio
from starlette.concurrency import iterate_in_threadpool
from starlette.requests import Request

from session_runtime.api.errors import ApiError
from session_runtime.api.output_deltas import OutputDeltas
from session_runtime.backends.base import Cancellation
from session_runtime.errors import RuntimeErrorBase, StepCancelled
from session_runtime.step import Step
from session_runtime.templates.base import Template

Format = Callable[[str, object], dict]  # (kind, payload) -> event body
T = TypeVar("T")


@dataclass(frozen=True)
class Prefill:
    """A step's prompt, matched and prefilled, before its first output token."""

    prompt_tokens: int
    cached_tokens: int  # reused from the cache (device, or reloaded from the host)


# A step's typed events, in order: ("prefill", Prefill) once the prompt is matched
# (absent where a backend cannot tell), ("reasoning" | "content", text delta) as
# tokens decode, then ("step", Step) or ("error", ApiError). Each protocol route
# renders them in its own wire format (a Render).
Event = tuple[str, object]
Render = Callable[[Iterator[Event]], Iterator[str]]


def session_event(kind: str, payload: object) -> dict:
    if kind == "step":
        return {"type": "step", **payload.as_dict()}
    if kind == "error":
        return {"type": "error", "error": {"type": payload.kind, "message": payload.message, "status": payload.status}}
    return {"type": kind, "delta": payload}


def sse_step(run: Callable[..., Step], tpl: Template,
             fmt: Format = session_event, first: str = "", cancel: Optional[Cancellation] = None,
             on_late_error: Callable[[], None] = lambda: None, render: Optional[Render] = None,
             stop: Sequence[str] = ()) -> AsyncIterator[str]:
    """Start `run(on_token, cancel, on_prefill)` on its own thread and wait for
    its first event: a step that fails before it raises here, so the client
    gets the error's status instead of a 200 stream. Then return the SSE lines
    (after `first`): `render(events)` of the step's typed events, or by
    default each event but the prefill as `data: {fmt(kind, value)}`, ending
    with `data: [DONE]`. An error after the first event is an `error` event
    (and `on_late_error()`: the error handlers never see it). When the client
    goes away before the end, the step is cancelled. `stop`: the request's stop
    sequences, whose text is never sent."""
    events: queue.Queue = queue.Queue()
    cancel = cancel or Cancellation()

    def worker() -> None:
        try:
            events.put(("step", run(lambda tok: events.put(("token", tok)), cancel,
                                    lambda n, cached: events.put(("prefill", Prefill(n, cached))))))
        except RuntimeErrorBase as exc:
            events.put(("error", exc))
        except Exception as exc:  # an engine bug: reported rather than hang the stream, logged where it is answered
            events.put(("error", exc))

    threading.Thread(target=worker, name="sse-step", daemon=True).start()
    head = events.get()
    if head[0] == "error":
        raise head[1]  # nothing was sent yet: the error handlers answer with its status
    typed = step_events(events, tpl, head, on_late_error, stop)
    return _until_disconnect(render(typed) if render is not None else sse_lines(typed, fmt), cancel, first)


async def _until_disconnect(lines: Iterator[str], cancel: Cancellation, first: str) -> AsyncIterator[str]:
    """The lines, read on a worker thread. Starlette cancels this iterator when
    the client disconnects: the step is cancelled then (a no-op once it ended)."""
    try:
        if first:
            yield first
        async for line in iterate_in_threadpool(lines):
            yield line
    finally:
        cancel.cancel(StepCancelled("the client disconnected"))


async def cancellable(request: Request, fn: Callable[[Cancellation], T]) -> T:
    """Run `fn(cancel)` on a worker thread while watching the connection: a client
    that disconnects before it returns cancels the step it runs."""
    cancel = Cancellation()

    async def watch() -> None:
        # The body was read before the route ran: the next message is the
        # disconnect, if it comes while the step runs (waited for, not polled).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel.cancel(StepCancelled("the client disconnected"))

    # A plain asyncio task, not an anyio task group: spawning in one costs more
    # than the rest of a request's handling here (an Event and a backend lookup per task).
    watcher = asyncio.ensure_future(watch())
    try:
        return await anyio.to_thread.run_sync(fn, cancel)
    finally:
        watcher.cancel()


def step_events(events: queue.Queue, tpl: Template, head: tuple,
                on_late_error: Callable[[], None], stop: Sequence[str] = ()) -> Iterator[Event]:
    """The step's typed events (Event) from the worker's queue: tokens turned
    into reasoning and content deltas (output_deltas.py: text that may still
    become tool-call markup held back until the step ends)."""
    deltas = OutputDeltas(tpl, stop)
    while True:
        kind, value = head if head is not None else events.get()
        head = None
        if kind == "prefill":
            yield kind, value
            continue
        if kind == "error":
            on_late_error()
            if not isinstance(value, RuntimeErrorBase):  # its text goes to the log only
                logging.getLogger("session_runtime").error("internal error in a streamed step", exc_info=value)
            value = ApiError.of(value) if isinstance(value, RuntimeErrorBase) else ApiError(500, "internal", "internal error")
        if kind == "token":
            yield from deltas.push(value)
            continue
        if kind == "step":  # flush what was held back, now that the output is whole
            yield from deltas.finish(value.reasoning, value.content)
        yield kind, value
        return


def sse_lines(events: Iterator[Event], fmt: Format) -> Iterator[str]:
    """The chat route's and the session API's SSE lines: each event but the prefill, then [DONE]."""
    for kind, value in events:
        if kind != "prefill":
            yield f"data: {json.dumps(fmt(kind, value), ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
