"""What a step changed in a conversation since it was last written, by identity.

A step appends messages, trace entries and a step's accounting, and changes
the last turn's record; a turn's close replaces that turn's messages in the
canonical history (its reasoning dropped); a chat client's other history
replaces them all. Messages, trace entries and accounting are never changed
once made (a step replaces them), so the first position where the list holds
another object than the one written is where the rows to rewrite begin; the
turn records are changed in place, so the last one written is always written
again. A row written again replaces the one at its key (an upsert); rows are
deleted only past the end of a list that got shorter, so that a step is one
statement of rows however many it wrote (each statement of SQLite's releases
the GIL, a hand-off to another step's thread). `Written` remembers the
objects written and each row's size, and is kept only after the transaction
that wrote them committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from session_runtime.conversation import Conversation
from session_runtime.sequences import first_difference
from session_runtime.store.rows import HISTORY, STEP, TRACE, TURN, head_key, head_row, history_row, state_row, \
    step_row, trace_row, turn_row


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


@dataclass
class Written:
    """What the store holds of one conversation: the objects written, and each row's bytes."""

    history: list = field(default_factory=list)
    history_sizes: list = field(default_factory=list)
    trace: list = field(default_factory=list)
    trace_sizes: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    turn_sizes: list = field(default_factory=list)
    steps: list = field(default_factory=list)  # per turn: its steps' list as written
    step_sizes: list = field(default_factory=list)
    head: Optional[tuple] = None  # head_key of what was written
    head_size: int = 0
    state_size: int = 0
    rows_size: int = 0  # the sizes' sum, kept as rows come and go: a step adds what it wrote

    @property
    def bytes(self) -> int:
        return self.rows_size + self.head_size + self.state_size


@dataclass
class Delta:
    """Rows to delete (SQL condition, parameters past the conversation id) and
    rows to write (kind, seq, sub, data; each replaces the row at its key), the
    conversation's row, and what the store holds once they are written."""

    deletes: list = field(default_factory=list)
    inserts: list = field(default_factory=list)
    head: Optional[str] = None  # None: unchanged
    state: str = ""
    written: Written = field(default_factory=Written)


def _messages(d: Delta, kind: int, old: list, old_sizes: list, new: list, row) -> tuple[list, list]:
    k = first_difference(old, new)
    if len(new) < len(old):
        d.deletes.append(("kind = ? AND seq >= ?", (kind, len(new))))
    sizes = old_sizes[:k]
    d.written.rows_size -= sum(old_sizes[k:])
    for i in range(k, len(new)):
        data = row(new[i])
        d.inserts.append((kind, i, 0, data))
        sizes.append(_size(data))
    d.written.rows_size += sum(sizes[k:])
    return list(new), sizes


def delta(conv: Conversation, w: Optional[Written]) -> Delta:
    """The rows that make the store hold `conv`, given that it holds `w` (None: nothing)."""
    w = w or Written()
    d = Delta()
    n = d.written
    n.rows_size = w.rows_size
    n.history, n.history_sizes = _messages(d, HISTORY, w.history, w.history_sizes, conv.history, history_row)
    n.trace, n.trace_sizes = _messages(d, TRACE, w.trace, w.trace_sizes, conv.trace, trace_row)
    # Turns: from the first one replaced, and the last one written in any case (changed in place).
    k = min(first_difference(w.turns, conv.turns), max(len(w.turns) - 1, 0))
    if len(conv.turns) < len(w.turns):
        d.deletes.append(("kind = ? AND seq >= ?", (TURN, len(conv.turns))))
    n.turns, n.turn_sizes = list(conv.turns), w.turn_sizes[:k]
    # The turns before k keep their lists as written: no Written changes a list it holds.
    n.steps, n.step_sizes = w.steps[:k], w.step_sizes[:k]
    n.rows_size -= sum(w.turn_sizes[k:]) + sum(map(sum, w.step_sizes[k:]))  # written again below
    for t in range(k, len(conv.turns)):
        record = conv.turns[t]
        data = turn_row(record)
        d.inserts.append((TURN, t, 0, data))
        n.turn_sizes.append(_size(data))
        # The steps of the record written before (the same object): from the first new one.
        s = first_difference(w.steps[t], record.steps) if t < len(w.turns) and w.turns[t] is record else 0
        if t < len(w.steps) and len(record.steps) < len(w.steps[t]):
            d.deletes.append(("kind = ? AND seq = ? AND sub >= ?", (STEP, t, len(record.steps))))
        sizes = w.step_sizes[t][:s] if s else []
        for i in range(s, len(record.steps)):
            data = step_row(record.steps[i])
            d.inserts.append((STEP, t, i, data))
            sizes.append(_size(data))
        n.steps.append(list(record.steps))
        n.step_sizes.append(sizes)
        n.rows_size += n.turn_sizes[-1] + sum(sizes)
    if len(w.steps) > len(conv.turns):  # fewer turns than written (a client's other history)
        d.deletes.append(("kind = ? AND seq >= ?", (STEP, len(conv.turns))))
    key = head_key(conv)
    if key != w.head:
        d.head = head_row(conv)
        n.head, n.head_size = key, _size(d.head)
    else:
        n.head, n.head_size = w.head, w.head_size
    d.state = state_row(conv)
    n.state_size = _size(d.state)
    return d


def written_of(conv: Conversation, rows: list[tuple[int, int, int, str]], head: str, state: str) -> Written:
    """What the store holds of a conversation just loaded from these rows."""
    w = Written(history=list(conv.history), trace=list(conv.trace), turns=list(conv.turns),
                steps=[list(t.steps) for t in conv.turns], head=head_key(conv), head_size=_size(head),
                state_size=_size(state))
    w.step_sizes = [[] for _ in conv.turns]
    for kind, seq, _sub, data in rows:
        size = _size(data)
        if kind == HISTORY:
            w.history_sizes.append(size)
        elif kind == TRACE:
            w.trace_sizes.append(size)
        elif kind == TURN:
            w.turn_sizes.append(size)
        else:
            w.step_sizes[seq].append(size)
        w.rows_size += size
    return w
