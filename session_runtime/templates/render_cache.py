"""Renders that extend earlier ones walk only what is new.

A step renders its conversation a few times (the prompt, the history before
it, keep and drop for the counterfactual, the canonical sequence at a turn's
close and the policies' shadows), and each of those is the previous step's
rendering plus what the step added. Rendering is segment-wise (base.py): a
message group's ids are a function of the group and whether its turn keeps
its reasoning, never of what follows it. So a rendering is cut at group ends,
and a new one that starts with the same message objects, kept the same way,
under the same system prompt and tools, starts from the ids the old one had
at the last group end they share. The comparisons run in C (`map` over the
two lists); a render costs a copy of the shared ids plus the new groups, and
`length` (a step's history length) reads a kept rendering's mark, no copy.

Whether a message's turn keeps its reasoning is, for the runtime's rules, a
threshold on its turn (`KeepFrom`): where an entry's messages are in turn
order, the shared prefix is too, and the two renderings' keep flags part at
one bisection, so no list of flags is built per render (it was a third of a
render's time at 300 turns). Other rules, or messages out of turn order, ask
each message, as before.

Entries keep their messages and tools alive, so identity is never reused
while an entry holds them. Bounded by the tokens held (LRU).
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from session_runtime.sequences import first_difference
from session_runtime.templates.base import KeepReasoning, Message, Rendered, in_turn_order, keeping_starts, \
    message_groups

_turn = operator.attrgetter("turn")
PER_BUCKET = 8  # renderings kept per first message: the step's few kinds of render


def _length(entry: "_Entry") -> int:
    return len(entry.messages)


def _kept(keep: KeepReasoning, messages: list) -> list:
    """Per message: does its turn keep its reasoning (`base.keeping_starts`)."""
    k = keeping_starts(keep, messages)
    if k is None:
        return list(map(keep, map(_turn, messages)))
    return [False] * k + [True] * (len(messages) - k)


@dataclass
class _Entry:
    system: Optional[str]
    tools: Sequence[dict]
    messages: list
    keep: KeepReasoning
    first: Optional[float]  # keep's threshold (KeepFrom.first), None for another rule
    ordered: bool  # the messages' turns are in order
    ends: list  # message index after each closed group (0: the header alone)
    marks: list  # (ids, spans) lengths at each of `ends`
    out: Rendered  # owned by the cache: never handed out
    flags: Optional[list] = None  # per message, its turn keeps its reasoning: built when asked

    def kept(self) -> list:
        if self.flags is None:
            self.flags = _kept(self.keep, self.messages)
        return self.flags

    def kept_agree(self, messages: list, shared: int, keep: KeepReasoning, first: Optional[float]) -> int:
        """Where this entry's keep flags and `keep`'s over `messages` part, within
        the first `shared` messages (the same objects in both)."""
        if first is None or self.first is None or not self.ordered:
            return first_difference(self.kept()[:shared], _kept(keep, messages[:shared]), operator.ne)
        if first == self.first:
            return shared
        lo, hi = min(first, self.first), max(first, self.first)  # the flags differ on turns in [lo, hi)
        i = bisect.bisect_left(self.messages, lo, 0, shared, key=_turn)
        return i if i < shared and self.messages[i].turn < hi else shared


class RenderCache:
    """The last renderings of each conversation (keyed by its first message)."""

    def __init__(self, max_tokens: int = 1 << 23):
        self.max_tokens = max_tokens
        self._buckets: OrderedDict = OrderedDict()  # id(first message) -> [entry], most recent last
        self._tokens = 0
        self._lock = threading.Lock()

    def _best(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
              keep: KeepReasoning) -> tuple[Optional[_Entry], int]:
        """The entry to extend and the index of its group end to extend from
        (None, 0: none). Under the lock."""
        first = getattr(keep, "first", None)
        best, at = None, 0
        # Longest first: an entry can extend no further than it or this rendering
        # goes, so once the best found reaches that, the rest are not compared.
        for e in sorted(self._buckets.get(id(messages[0]) if messages else None, ()), key=_length, reverse=True):
            if best is not None and min(len(e.messages), len(messages)) <= best.ends[at]:
                break
            if e.system != system or e.tools is not tools:
                continue
            shared = first_difference(e.messages, messages)
            if best is not None and shared <= best.ends[at]:
                continue
            shared = min(shared, e.kept_agree(messages, shared, keep, first))
            i = bisect.bisect_right(e.ends, shared) - 1
            if best is None or e.ends[i] > best.ends[at]:
                best, at = e, i
        return best, at

    def length(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
               keep: KeepReasoning, without_last_span: bool = False) -> Optional[int]:
        """How many ids `render` would return, read from a kept rendering that
        has a group end at the messages' end (no ids copied); None where none
        has. `without_last_span`: up to the start of the last span instead."""
        if not messages:
            return None
        with self._lock:
            best, at = self._best(system, tools, messages, keep)
            if best is None or best.ends[at] != len(messages):
                return None
            n_ids, n_spans = best.marks[at]
            if not without_last_span:
                return n_ids
            return best.out.spans[n_spans - 1].start if n_spans else None

    def render(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
               keep: KeepReasoning, head: Callable[[Rendered], None],
               group: Callable[[Rendered, str, list, bool], None]) -> Rendered:
        """`head(out)` writes the system part, `group(out, role, messages, kept)`
        a message group; returns a fresh Rendered the caller may change."""
        messages = list(messages)
        first = getattr(keep, "first", None)
        key = id(messages[0]) if messages else None
        with self._lock:
            best, at = self._best(system, tools, messages, keep)
            if best is None:
                out, ends, marks, start = Rendered(), [], [], 0
            else:
                n_ids, n_spans = best.marks[at]
                out = Rendered(best.out.ids[:n_ids], best.out.spans[:n_spans])
                ends, marks, start = best.ends[: at + 1], best.marks[: at + 1], best.ends[at]
        if best is None:
            head(out)
            ends.append(0)
            marks.append((len(out.ids), len(out.spans)))
        i = start
        for role, g in message_groups(messages[start:]):
            group(out, role, g, keep(g[0].turn))  # a group's messages share their turn
            i += len(g)
            if role != "tool" or i < len(messages):  # a run of results at the end may go on
                ends.append(i)
                marks.append((len(out.ids), len(out.spans)))
        # In order: what the entry extended from was (the same objects up to `start`), and what follows is.
        ordered = in_turn_order(messages[max(start - 1, 0):] if best is not None and best.ordered else messages)
        self._keep(_Entry(system, tools, messages, keep, first, ordered, ends, marks,
                          Rendered(list(out.ids), list(out.spans))),
                   key, best if best is not None and start == len(best.messages) else None)
        return out

    def _keep(self, entry: _Entry, key, replaced: Optional[_Entry]) -> None:
        with self._lock:
            bucket = self._buckets.pop(key, [])
            if replaced is not None and replaced in bucket:  # the new one extends it
                bucket.remove(replaced)
                self._tokens -= len(replaced.out.ids)
            bucket.append(entry)
            self._tokens += len(entry.out.ids)
            while len(bucket) > PER_BUCKET:
                self._tokens -= len(bucket.pop(0).out.ids)
            self._buckets[key] = bucket
            while self._tokens > self.max_tokens and self._buckets:
                _, old = self._buckets.popitem(last=False)
                self._tokens -= sum(len(e.out.ids) for e in old)
