"""A conversation's last outbound request, message by message, so that the
next step's request is built, parsed, stripped, rendered and counted only past
what it shares with it.

A conversation's steps in upstream mode send its whole history each time (a
provider's API is stateless), and the next step's history is the last one plus
the step's own messages. `PrefixMap` keeps each stage's inputs and outputs;
the next call finds where the new inputs part from the last ones (by
identity, compared in C: `sequences.first_difference`) and computes only past
that point, so a step's Python work is the new messages', whatever the length
of the conversation. What remains proportional to the history is C work:
list copies, sums and the JSON encoding of the body that goes out.

Identity is sound here because a map holds its last inputs (strong references
to its conversation's own messages, which are never changed in place): no
object it compares against can die and leave its id to another. The state is
owned by the conversation (`Conversation.outbound`), leaves memory with it,
and is only a cache: any state, stale or empty, gives the same request.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from session_runtime.sequences import first_difference


class PrefixMap:
    """`f(i, x)` over a list, recomputed only from the first index where the
    list parts (by identity) from the last one given, or from `start`. The
    last inputs, outputs and `tag` (what the caller computed them under) are
    one value, replaced only when a call succeeds."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[list, list, Any] = ([], [], None)

    @property
    def tag(self) -> Any:
        return self._last[2]

    def map(self, inputs: Sequence, f: Callable[[int, Any], Any], start: Optional[int] = None,
            tag: Any = None) -> list:
        last_inputs, last_outputs, _ = self._last
        k = first_difference(last_inputs, inputs)
        if start is not None:
            k = min(k, start)
        outputs = last_outputs[:k]
        outputs += [f(i, x) for i, x in enumerate(inputs[k:], k)]
        self._last = (list(inputs), outputs, tag)
        return outputs


class OutboundPrefix:
    """One conversation's outbound stages (Chat Completions and Anthropic):
    stored message -> wire message (`transcript.py`; `joined`: Anthropic's,
    where a run of tool results is one message), wire message -> parsed
    message, parsed message -> what goes out and its counts (`outbound.py`).
    The `sent` map's tag is the history boundary of the last request: the
    messages before it were stripped as history."""

    __slots__ = ("wire", "parsed", "sent", "joined", "_system")

    def __init__(self) -> None:
        self.wire, self.parsed, self.sent = PrefixMap(), PrefixMap(), PrefixMap()
        self.joined: Optional[tuple] = None  # (stored messages, their pieces, wire messages, owner, first)
        self._system: Optional[tuple[str, Any]] = None

    def system_message(self, text: str, build: Callable[[str], Any]) -> Any:
        """The system message's wire form, the same object while the text is the same."""
        if self._system is None or self._system[0] != text:
            self._system = (text, build(text))
        return self._system[1]
