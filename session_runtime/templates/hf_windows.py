"""Template `hf` rendered window by window: a step's Jinja work in the size of
its turn, not of the whole conversation.

`hf.py` builds a prompt from the template's renderings of prefixes of the
conversation. Rendered whole, each such prefix costs Jinja (and the head's
tokenizing) in the length of the history: at turn 300 of an agent session,
hundreds of milliseconds a request. Most chat templates render a message from
the message, the tools and where it stands against the turn's user message
(Qwen3 and GLM-4.5 show reasoning only after the last user query, gpt-oss its
analysis only in the open turn), never from what came turns before. For them,
with W any user message at or before the prefixes' ends:

- what a template adds between two prefixes `dicts[:a]` and `dicts[:b]` is
  what it adds between `system + dicts[W:a]` and `system + dicts[W:b]`: the
  window that opens at the turn's user message;
- the closed history (as it reads before a next user message) is the system
  part followed by each turn's closed window without its system part, so the
  head is kept per turn and grows by one window when a turn closes.

`WindowedRender` renders so. Whether a template is one of those is checked
when it is loaded (`windows_hold`): a few conversations of every shape
(system or none, tools, calls and results, reasoning kept and dropped, the
generated ids replayed) rendered both ways must give the same ids; where one
differs, or the windowed way refuses what the whole way renders, the template
is rendered whole, as before.
"""

from __future__ import annotations

import bisect
import json
import logging
from typing import Callable, Optional, Protocol, Sequence

from session_runtime.bounded_cache import BytesLRU
from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import KeepFrom, Message, Rendered, ToolCall, message_groups
from session_runtime.templates.hf_messages import TemplateMessages
from session_runtime.templates.official import OfficialRenderer, RenderedText, prefix_digests, text_digest as _digest

SENTINEL = "\ue001next\ue001"  # a user message's content no client text spells



class WindowHost(Protocol):
    """What a window needs of the template it renders for (templates/hf.py's
    HFTemplate): its official renderer and the pieces of its incremental render."""

    official: OfficialRenderer
    messages: TemplateMessages
    _user_header: str
    _heads: Callable[[str], tuple]

    def _generated(self, output_ids: Sequence[int], rendered: RenderedText) -> tuple: ...

    def _appended(self, before: list[dict], after: list[dict], tools: list[dict], kind: str,
                  before_key: bytes, after_key: bytes) -> list[int]: ...

    def _head_spans(self, key: str) -> tuple: ...

    def forced_ids(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall] = ()) -> list[int]: ...

log = logging.getLogger(__name__)
_KIND = {"user": "user", "assistant": "answer", "tool": "tool_result", "system": "system"}
Spans = tuple[tuple[str, tuple[int, ...]], ...]


class WindowedRender:
    """The windowed renderings of one HFTemplate, and its closed heads per turn."""

    def __init__(self, tpl: WindowHost):
        self.tpl = tpl
        # digest of (tools, the messages before a user message) -> the closed head's spans
        size = lambda key, spans: 100 + sum(8 * len(ids) + 60 for _, ids in spans)  # noqa: E731
        self._closed = BytesLRU(64 << 20, size)
        self._system_texts = BytesLRU(1 << 20, lambda key, hit: 200)
        self._windows = BytesLRU(64 << 20, size)  # digest of a window -> its spans
        # (window digests, role, id of the replayed message) -> (that message, the group's spans)
        self._groups = BytesLRU(64 << 20, lambda key, hit: size(key, hit[1]) + _kept_bytes(hit[0]))

    def render(self, out: Rendered, dicts: list[dict], tools: list[dict], offset: int, messages: Sequence[Message],
               groups: list, ends: list[int], first_kept: Optional[int], keep, generation_prompt: bool) -> None:
        """HFTemplate.render's work after its set-up, for a conversation that
        opens with a user message."""
        tpl = self.tpl
        users = [offset + i for i, m in enumerate(messages) if m.role == "user"]
        blobs = tpl.messages.blobs(dicts, offset, messages)
        if first_kept is None:
            out_spans, start = self._closed_spans(dicts, tools, offset, blobs, users, len(dicts)), len(groups)
        else:
            at = offset + ends[first_kept] - 1  # the first kept turn's user message
            out_spans, start = self._closed_spans(dicts, tools, offset, blobs, users, at), first_kept + 1
            out_spans = out_spans + self._window([*dicts[:offset], dicts[at]], [*blobs[:offset], blobs[at]], tools,
                                                 offset, messages[at - offset:at - offset + 1], closed=False)
        for kind, ids in out_spans:
            out.add(kind, list(ids))
        carry = None  # a stop token the model ended with that the next message's text opens with (GLM)
        for g in range(start, len(groups)):
            role, group = groups[g]
            a, b = offset + ends[g] - len(group), offset + ends[g]
            w = _last_below(users, a if role == "user" else a + 1)  # the window opens at the turn's user message
            replayed = role == "assistant" and bool(group[0].output_ids) and keep(group[0].turn)
            (kind, ids), *rest = self._group(dicts, blobs, tools, offset, w, a, b, role, group[0] if replayed else None)
            out.add(kind, ids[1:] if carry is not None and ids[:1] == (carry,) else ids)
            carry = None
            for kind, ids in rest:
                if kind == "carry":
                    carry = ids[0]
                else:
                    out.add(kind, ids)
        if generation_prompt and messages and messages[-1].role != "assistant":
            window = [*dicts[:offset], *dicts[users[-1]:]]
            key, = prefix_digests(window, tools, [len(window)], blobs=[*blobs[:offset], *blobs[users[-1]:]])
            prompt = tpl.official.render(window, tools, True, key)
            base = tpl.official.render(window, tools, False, key).text
            assert prompt.text.startswith(base), "generation prompt is not an append"
            ids = tpl.official.encode(prompt, len(base))
            out.add("generation_prompt", ids[1:] if carry is not None and ids[:1] == [carry] else ids)

    def _group(self, dicts: list[dict], blobs: list[bytes], tools: list[dict], offset: int, w: int, a: int, b: int,
               role: str, replayed: Optional[Message]) -> Spans:
        """The spans of the group dicts[a:b] in the window opening at `w`: its
        text, or (`replayed`, a kept assistant message) the generation prompt,
        the ids as generated and the template's end, then ("carry", (id,))
        where the next message's text opens with the stop token it ended with.
        Kept per window and message: a step renders the same groups for the
        prompt, its history and keep's counterfactual."""
        head = dicts[:offset]
        before, after = [*head, *dicts[w:a]], [*head, *dicts[w:b]]
        ka, kb = prefix_digests(after, tools, [len(before), len(after)], blobs=[*blobs[:offset], *blobs[w:b]])
        key = (ka, kb, role, id(replayed) if replayed is not None else None)
        hit = self._groups.get(key)
        if hit is not None and hit[0] is replayed:
            return hit[1]
        tpl = self.tpl
        if replayed is not None:
            plain = tpl.official.render(before, tools, False, ka)
            prompt = tpl.official.render(before, tools, True, ka)
            assert prompt.text.startswith(plain.text), "generation prompt is not an append"
            ids, carry, end = tpl._generated(replayed.output_ids, tpl.official.render(after, tools, False, kb))
            spans = (("generation_prompt", tuple(tpl.official.encode(prompt, len(plain.text)))), ("output", tuple(ids)),
                     ("eos", tuple(end)), *((("carry", (carry,)),) if carry is not None else ()))
        else:
            spans = ((_KIND[role], tuple(tpl._appended(before, after, tools, _KIND[role], ka, kb))),)
        self._groups.put(key, (replayed, spans))  # the message kept alive: its id is not reused meanwhile
        return spans

    def _closed_spans(self, dicts: list[dict], tools: list[dict], offset: int, blobs: list[bytes],
                      users: list[int], end: int) -> Spans:
        """The closed rendering of dicts[:end] (as it reads before a next user
        message): the system part, then each turn's closed window; kept per
        turn, so a step renders only the windows of turns closed since."""
        bounds = [u for u in users if offset < u < end] + [end]
        digests = prefix_digests(dicts, tools, [offset, *bounds], salt=("closed", offset), blobs=blobs)
        k = len(digests) - 1
        while k >= 0 and self._closed.get(digests[k]) is None:
            k -= 1
        if k < 0:
            spans, k = self._system(dicts[:offset], tools, offset), 0
            self._closed.put(digests[0], spans)
        else:
            spans = self._closed.get(digests[k])
        starts = [offset, *bounds]
        for j in range(k, len(starts) - 1):
            a, b = starts[j], starts[j + 1]
            spans = spans + self._window([*dicts[:offset], *dicts[a:b]], [*blobs[:offset], *blobs[a:b]], tools,
                                         offset, _messages_of(dicts, offset, a, b), closed=True)
            self._closed.put(digests[j + 1], spans)
        return spans

    def _system(self, head: list[dict], tools: list[dict], offset: int) -> Spans:
        """The closed rendering of the system part alone (the tools' block where
        the template writes one without a system message)."""
        return self.tpl._heads(json.dumps([head, tools, offset, [], [], True], ensure_ascii=False))

    def _system_text(self, head: list[dict], tools: list[dict]) -> tuple[int, str]:
        """(length, digest) of the text of the system part alone, closed."""
        key = prefix_digests(head, tools, [len(head)], salt="system")[0]
        hit = self._system_texts.get(key)
        if hit is None:
            text = self.tpl.official.text([*head, {"role": "user", "content": SENTINEL}], tools, False)
            cut = text.index(SENTINEL) - len(self.tpl._user_header)
            hit = (cut, _digest(text[:cut]).hex())
            self._system_texts.put(key, hit)
        return hit

    def _window(self, window: list[dict], blobs: list[bytes], tools: list[dict], offset: int, messages,
                closed: bool) -> Spans:
        """The spans of a window's messages (`blobs`: theirs and the system
        part's): the window's head rendering from where its system part ends
        (that part neither tokenized nor kept). Kept by the window's digest."""
        groups = list(message_groups(messages))
        kinds, sizes = [_KIND[role] for role, _ in groups], [len(g) for _, g in groups]
        key = (prefix_digests(window, tools, [len(window)], salt=(offset, kinds, sizes, closed), blobs=blobs)[0])
        hit = self._windows.get(key)
        if hit is None:
            head = json.dumps([window, tools, offset, kinds, sizes, closed, self._system_text(window[:offset], tools)],
                              ensure_ascii=False)
            hit = tuple((kind, ids) for kind, ids in self.tpl._head_spans(head) if ids)
            self._windows.put(key, hit)
        return hit


class WindowMismatch(InvalidRequest):
    """The template renders a window unlike the whole conversation."""


def _kept_bytes(m: Optional[Message]) -> int:
    """About what a message kept alive by a memo holds."""
    return 0 if m is None else 8 * len(m.output_ids) + 2 * (len(m.content) + len(m.reasoning)) + 300


def _last_below(users: list[int], limit: int) -> int:
    """The last user message's index below `limit` (`users` ascending)."""
    return users[bisect.bisect_left(users, limit) - 1]


def _messages_of(dicts: list[dict], offset: int, a: int, b: int) -> list[Message]:
    """Messages with the roles of dicts[a:b] (their groups are all a window's spans need)."""
    return [Message(d["role"], 0) for d in dicts[a:b]]


# ----- the check when a template is loaded --------------------------------------------------


_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a thing up.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def _probe_messages(tpl: WindowHost, calls: bool, replayed: bool) -> list[Message]:
    def assistant(turn: int, reasoning: str, content: str, tool_calls=()) -> Message:
        ids = tuple(tpl.forced_ids(reasoning, content, tool_calls)) if replayed else ()
        return Message("assistant", turn, content=content, reasoning=reasoning, tool_calls=tuple(tool_calls),
                       output_ids=ids)

    first, second = ToolCall("call_a", "lookup", {"query": "one"}), ToolCall("call_b", "lookup", {"query": "two"})
    out = [Message("user", 0, content="First question?")]
    if calls:
        out += [assistant(0, "I need to look.", "", (first,)), Message("tool", 0, content="one: 1", tool_call_id="call_a")]
    out += [assistant(0, "Thought one.", "First answer."), Message("user", 1, content="Second question?"),
            assistant(1, "Thought two.", "Second answer."), Message("user", 2, content="Third question?")]
    if calls:
        out += [assistant(2, "Look again.", "", (second,)), Message("tool", 2, content="two: 2", tool_call_id="call_b")]
    return out


def windows_hold(tpl: WindowHost) -> bool:
    """Does the template render the probe conversations the same window by window as whole?"""
    whole = tpl.windowed
    shapes = 0
    try:
        for system in (None, "Be brief."):
            for tools, calls in (([], False), ([_TOOL], False), ([_TOOL], True)):
                for replayed in (False, True):
                    try:
                        messages = _probe_messages(tpl, calls, replayed)
                    except InvalidRequest:
                        continue
                    for n in range(1, len(messages) + 1):
                        for keep in (KeepFrom(99), KeepFrom(0), KeepFrom(messages[n - 1].turn)):
                            for gen in ((True, False) if messages[n - 1].role != "assistant" else (False,)):
                                tpl.windowed = None
                                try:
                                    want = tpl.render(system, tools, messages[:n], keep, gen).ids
                                except InvalidRequest:
                                    continue
                                tpl.windowed = whole
                                try:
                                    got = tpl.render(system, tools, messages[:n], keep, gen).ids
                                except InvalidRequest as exc:
                                    log.info("chat template rendered whole: a window refused (%s)", exc)
                                    return False
                                if got != want:
                                    log.info("chat template rendered whole: a window renders unlike the whole "
                                             "(%d messages, system %r, tools %d)", n, system, len(tools))
                                    return False
                                shapes += 1
    finally:
        tpl.windowed = whole
    return shapes > 0
