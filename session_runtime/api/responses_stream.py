"""A streamed `/v1/responses` answer: the step's typed events (api/streaming.py)
rendered as Responses' events, in the order OpenAI sends them:

    response.created, response.in_progress,
    reasoning: output_item.added, content_part.added (reasoning_text),
               reasoning_text.delta..., reasoning_text.done, content_part.done, output_item.done
    text:      output_item.added, content_part.added (output_text),
               output_text.delta..., output_text.done, content_part.done, output_item.done
    each call: output_item.added, function_call_arguments.delta, function_call_arguments.done,
               output_item.done
    response.completed (or response.incomplete when max_output_tokens ran out)

each as `event: TYPE` and `data: JSON` with `type` and `sequence_number`.
Reasoning goes out as `reasoning_text` (the raw text, as OpenAI's
open-weight reasoning models stream it), not as a summary. The engine
decodes tool calls only when the step ends, so each call's arguments come in
one delta. An error after the stream started is a `response.failed` event
(before it, the route answers with the error's status).
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Iterator, Optional

from session_runtime.api.openai_compat import FINISH, chat_usage, tool_calls
from session_runtime.api.streaming import Event
from session_runtime.api.responses_output import (
    Encrypt, OutputIds, call_item, failed, finished, message_item, reasoning_item, reasoning_part, text_part,
)


class ResponseEvents:
    """Renders a step's typed events as Responses events; `on_done(response)` is called with
    the finished response before `response.completed` goes out (the route
    stores it then)."""

    def __init__(self, base: dict, ids: OutputIds, encrypt: Optional[Encrypt],
                 on_done: Callable[[dict], None] = lambda response: None):
        self.base, self.ids, self.encrypt, self.on_done = base, ids, encrypt, on_done
        self.sequence = 0
        self.items: list[dict] = []  # the items done so far, as they will be in the response
        self.open: Optional[str] = None  # "reasoning" or "message": the item being streamed
        self.text = {"reasoning": "", "message": ""}
        self.ended = False

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.base),
                self.event("response.in_progress", response=self.base)]

    def render(self, events: Iterator[Event]) -> Iterator[str]:
        """Responses' events for the step's typed events (the prefill has no event of its own here)."""
        yield from self.start()
        for kind, value in events:
            if kind == "reasoning":
                yield from self._delta("reasoning", value)
            elif kind == "content":
                yield from self._delta("message", value)
            elif kind == "error":
                yield from self.fail({"code": value.kind, "message": value.message})
                return
            elif kind == "step":
                yield from self._finish(tool_calls(value), FINISH.get(value.finish_reason, "stop"), chat_usage(value))
        if not self.ended:  # the events ended without the step
            yield from self.fail({"message": "the step ended without an answer"})

    def fail(self, error: dict) -> list[str]:
        self.ended = True
        return [self.event("response.failed", response=failed(self.base, self.items, error))]

    def _delta(self, field: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open != field:
            if field == "reasoning" and self.open == "message":
                # Not expected (the step's reasoning is whole before its answer): kept in the
                # reasoning text, without reopening the closed item.
                self.text["reasoning"] += text
                return []
            out += self._close(incomplete=False)
            out += self._add(field)
        self.text[field] += text
        index = len(self.items)
        if field == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=self.ids.reasoning, output_index=index,
                                  content_index=0, delta=text))
        else:
            out.append(self.event("response.output_text.delta", item_id=self.ids.message, output_index=index,
                                  content_index=0, delta=text, logprobs=[]))
        return out

    def _add(self, field: str) -> list[str]:
        self.open = field
        index = len(self.items)
        if field == "reasoning":
            item, part, item_id = reasoning_item(self.ids, None, None), reasoning_part(""), self.ids.reasoning
        else:
            item, part, item_id = message_item(self.ids, None, "in_progress"), text_part(""), self.ids.message
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=part)]

    def _close(self, incomplete: bool) -> list[str]:
        field, self.open = self.open, None
        if field is None:
            return []
        index, text = len(self.items), self.text[field]
        if field == "reasoning":
            item, part, item_id = reasoning_item(self.ids, text, self.encrypt), reasoning_part(text), self.ids.reasoning
            done = self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text)
        else:
            item = message_item(self.ids, text, "incomplete" if incomplete else "completed")
            part, item_id = text_part(text), self.ids.message
            done = self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text, logprobs=[])
        self.items.append(item)
        return [done, self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                 part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _finish(self, calls: list[dict], finish_reason: str, usage: Optional[dict]) -> list[str]:
        incomplete = finish_reason == "length"
        out = self._close(incomplete)
        if not self.items and not calls:  # nothing at all: an empty message, as a plain answer has
            out += self._add("message") + self._close(incomplete)
        for call in calls:
            index, arguments = len(self.items), call["function"]["arguments"]
            item = call_item(self.ids, call, arguments, "completed")
            out.append(self.event("response.output_item.added", output_index=index,
                                  item={**call_item(self.ids, call, None, "in_progress")}))
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=arguments))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=arguments))
            self.items.append(item)
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        response = finished(self.base, self.items, finish_reason, usage)
        try:
            self.on_done(response)
        except Exception as exc:  # the step is committed; the response could not be kept
            logging.getLogger("session_runtime").error("a streamed response could not be stored", exc_info=exc)
            return out + self.fail({"message": f"the response could not be stored: {exc}"})
        self.ended = True
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=response)]
