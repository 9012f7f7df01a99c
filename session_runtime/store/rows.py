"""A conversation as the store's rows (sqlite.py), and back.

The rows are what a step appends: one per message of the canonical history
and of the trace, one per turn record (without its steps), one per step's
accounting; the conversation's own row holds its settings (`head`), what
changes every step but is small (`state`), and, written only when the
conversation leaves memory, what the runtime knew of its KV (`parked`).
Each row is a JSON text written by hand from the dataclass's fields
(`dataclasses.asdict` deep-copies and walks every value: it cost more than
the whole rest of a step).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from session_runtime.accounting import StepAccounting, plain_dict
from session_runtime.conversation import Conversation, ProtocolState, TraceEntry, TurnRecord
from session_runtime.offload import OffloadSettings
from session_runtime.policies import MaterializeSettings, ReasoningPolicy
from session_runtime.protocols.base import compact
from session_runtime.templates.base import Message, ToolCall
from session_runtime.tool_clearing import Cleared
from session_runtime.uncached import Known

HISTORY, TRACE, TURN, STEP = 0, 1, 2, 3  # conv_rows.kind

_TURN_FIELDS = tuple(f.name for f in dataclasses.fields(TurnRecord) if f.name != "steps")
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepAccounting))
_KNOWN_FIELDS = tuple(f.name for f in dataclasses.fields(Known))


def message_dict(m: Message) -> dict:
    """Only what differs from the defaults (a user message is its role, turn and text)."""
    d = {"role": m.role, "turn": m.turn}
    if m.content:
        d["content"] = m.content
    if m.reasoning:
        d["reasoning"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [c.as_dict() for c in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.output_ids:
        d["output_ids"] = list(m.output_ids)
    if m.wire:
        d["wire"] = m.wire
    return d


def message_of(d: dict) -> Message:
    calls = tuple(ToolCall(**c) for c in d.get("tool_calls", ()))
    return Message(**{**d, "tool_calls": calls, "output_ids": tuple(d.get("output_ids", ()))})


def history_row(m: Message) -> str:
    return compact(message_dict(m))


def trace_row(e: TraceEntry) -> str:
    return compact({"message": message_dict(e.message), "step": e.step, "finish_reason": e.finish_reason,
                   "created_at": e.created_at})


def trace_of(d: dict) -> TraceEntry:
    return TraceEntry(message_of(d["message"]), d["step"], d["finish_reason"], d["created_at"])


def turn_row(t: TurnRecord) -> str:
    return compact({name: getattr(t, name) for name in _TURN_FIELDS})


def step_row(s: StepAccounting) -> str:
    return compact({name: getattr(s, name) for name in _STEP_FIELDS})


def head_row(conv: Conversation) -> str:
    """The settings: written when they change (a client's new system prompt or tools)."""
    return compact({"system": conv.system, "tools": conv.tools, "template": conv.template,
                   "policy": plain_dict(conv.policy), "materialize": plain_dict(conv.materialize),
                   "offload": plain_dict(conv.offload),
                   **({"inferred": conv.inferred, "call_prefix": conv.call_prefix} if conv.inferred else {}),
                   **({"cleared": conv.cleared.as_dict()} if conv.cleared else {})})


def head_key(conv: Conversation) -> tuple:
    """What `head_row` is a function of, compared by value (`tools` by identity and length: a
    client's new tools are a new list)."""
    return (conv.system, id(conv.tools), len(conv.tools), conv.template, conv.policy, conv.materialize,
            conv.offload, conv.inferred, conv.cleared)


def state_row(conv: Conversation) -> str:
    p = conv.protocol
    return compact({"version": conv.version, "protocol": None if p is None else {
        "turn": p.turn, "pending_calls": [c.as_dict() for c in p.pending_calls],
        "generated_ids": list(p.generated_ids)}})


def protocol_of(p: Optional[dict]) -> Optional[ProtocolState]:
    """The open turn's state as `state_row` (and the first schema) wrote it."""
    return None if p is None else ProtocolState(
        p["turn"], tuple(ToolCall(**c) for c in p["pending_calls"]), tuple(p["generated_ids"]))


def parked_row(conv: Conversation, boot: str) -> str:
    """What the runtime knew of the conversation's KV, for this process only (`boot`):
    its chain is still held by the backend while the conversation is out of memory."""
    return compact({"boot": boot, "chain_tokens": list(conv.chain_tokens), "canonical_kind": conv.canonical_kind,
                   "shadows": {k: list(v) for k, v in conv.shadows.items()},
                   "known": {name: (list(v) if name == "sequence" else v)
                             for name in _KNOWN_FIELDS for v in [getattr(conv.known, name)]}})


def conversation_of(cid: str, tenant: Optional[str], worker: Optional[str], head: str, state: str,
                    rows: list[tuple[int, int, int, str]]) -> Conversation:
    """The conversation from its row and its rows (kind, seq, sub, data), in key order."""
    h, s = json.loads(head), json.loads(state)
    history, trace, turns = [], [], []
    for kind, seq, _sub, data in rows:
        d = json.loads(data)
        if kind == HISTORY:
            history.append(message_of(d))
        elif kind == TRACE:
            trace.append(trace_of(d))
        elif kind == TURN:
            turns.append(TurnRecord(**d))
        else:
            turns[seq].steps.append(StepAccounting(**d))  # the turns' rows all come first
    return _conversation(cid, tenant, worker, h, history, trace, turns, s["protocol"], s.get("version", 0))


def _conversation(cid, tenant, worker, head: dict, history, trace, turns, protocol, version: int) -> Conversation:
    """From the settings as `head_row` wrote them (the first schema's document has the same keys)."""
    return Conversation(
        id=cid, system=head["system"], tools=head["tools"], tenant=tenant, template=head["template"],
        policy=ReasoningPolicy(**head["policy"]), materialize=MaterializeSettings(**head["materialize"]),
        offload=OffloadSettings(**head.get("offload", {})), history=history, trace=trace, turns=turns,
        protocol=protocol_of(protocol), worker=worker, version=version,
        inferred=head.get("inferred"), call_prefix=head.get("call_prefix", "call"),
        cleared=Cleared(frozenset(head.get("cleared", {}).get("results", ())),
                        frozenset(head.get("cleared", {}).get("inputs", ()))),
        canonical_kind="none",  # the KV is gone after a restart: the next step starts from nothing cached
    )


def unpark(conv: Conversation, parked: Optional[str], boot: str) -> bool:
    """Put back what this process knew of the conversation's KV when it left
    memory; False when it was parked by another process (or never)."""
    if not parked:
        return False
    d = json.loads(parked)
    if d.get("boot") != boot:
        return False
    conv.chain_tokens = d["chain_tokens"]
    conv.canonical_kind = d["canonical_kind"]
    conv.shadows = d["shadows"]
    conv.known = Known(**d["known"])
    return True


def legacy_conversation(text: str) -> Conversation:
    """A conversation as the store's first schema kept it (one JSON document), for the migration."""
    d = json.loads(text)
    turns = [TurnRecord(**{**t, "steps": [StepAccounting(**s) for s in t["steps"]]}) for t in d["turns"]]
    return _conversation(d["id"], d["tenant"], d.get("worker"), d, [message_of(m) for m in d["history"]],
                         [trace_of(e) for e in d["trace"]], turns, d["protocol"], 0)
