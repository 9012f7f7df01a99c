"""Server-sent events for a step: reasoning and content deltas as tokens are
decoded, then one final event with the whole step and its accounting.

The step runs on its own thread and commits whatever happens to the client:
a client that disconnects mid-stream leaves a complete, consistent turn.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Callable, Iterator

from session_runtime.api.errors import ApiError
from session_runtime.errors import RuntimeErrorBase
from session_runtime.step import Step
from session_runtime.templates.base import Template

Format = Callable[[str, object], dict]  # (kind, payload) -> event body


def session_event(kind: str, payload: object) -> dict:
    if kind == "step":
        return {"type": "step", **payload.as_dict()}
    if kind == "error":
        return {"type": "error", "error": {"type": payload.kind, "message": payload.message, "status": payload.status}}
    return {"type": kind, "delta": payload}


def sse_step(run: Callable[[Callable[[int], None]], Step], tpl: Template, fmt: Format = session_event) -> Iterator[str]:
    """Start `run(on_token)` now, on its own thread, and return the SSE lines it
    produces, ending with `data: [DONE]`. The step runs to its end even if the
    client never reads a byte."""
    events: queue.Queue = queue.Queue()

    def worker() -> None:
        try:
            events.put(("step", run(lambda tok: events.put(("token", tok)))))
        except RuntimeErrorBase as exc:
            events.put(("error", ApiError.of(exc)))
        except Exception:  # an engine bug: report it rather than hang the stream; its text goes to the log only
            logging.getLogger("session_runtime").exception("internal error in a streamed step")
            events.put(("error", ApiError(500, "internal", "internal error")))

    threading.Thread(target=worker, name="sse-step", daemon=True).start()
    return _lines(events, tpl, fmt)


def _lines(events: queue.Queue, tpl: Template, fmt: Format) -> Iterator[str]:
    ids: list[int] = []
    sent = {"reasoning": "", "content": ""}
    while True:
        kind, value = events.get()
        if kind == "token":
            ids.append(value)
            parsed = tpl.parse_output(ids, "")
            for field, text in (("reasoning", parsed.reasoning), ("content", parsed.content)):
                text = safe_prefix(text, tpl.call_marker if field == "content" else "")
                if len(text) > len(sent[field]) and text.startswith(sent[field]):
                    yield f"data: {json.dumps(fmt(field, text[len(sent[field]):]), ensure_ascii=False)}\n\n"
                    sent[field] = text
            continue
        if kind == "step":  # flush what was held back, now that the output is whole
            for field, text in (("reasoning", value.reasoning), ("content", value.content)):
                if len(text) > len(sent[field]) and text.startswith(sent[field]):
                    yield f"data: {json.dumps(fmt(field, text[len(sent[field]):]), ensure_ascii=False)}\n\n"
        yield f"data: {json.dumps(fmt(kind, value), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
        return


def safe_prefix(text: str, marker: str) -> str:
    """The part of partly decoded text that can be sent and never taken back:
    without a trailing incomplete character (decoded as U+FFFD until its last
    byte arrives) and without anything that is, or may become, `marker` (the
    start of tool-call markup, which is not content)."""
    text = text.rstrip("\ufffd")
    if marker:
        cut = text.find(marker)
        if cut >= 0:
            return text[:cut]
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-keep:]):
                return text[:-keep]
    return text
