"""What a request carries for the tree, in SGLang's versioned `kv_hints` envelope.

Two action types of ours; the request's top-level `session_id` names the
conversation (the chain's owner). SGLang passes both to the tree unchanged
(`Req.session_id`, `Req.kv_hints`, and `TokenizedGenerateReqInput.kv_hints`
at intake); consumers ignore action types they do not implement.

- `session_runtime.chain` on every step: what the tree does with the chain
  because of this step. Before the request is scheduled (at intake, on every
  rank): probe the counterfactual prompts, promote the owner's host copy;
  when it finishes: hold the new tail or not, insert at most `cache_limit`
  tokens. What the tree found comes back in the request's `meta_info`.
- `session_runtime.command` on a request that carries only a command (one
  token, no output, nothing cached): what has no step of its own (release,
  snapshot, integrity check, ...). It travels SGLang's own request path, so
  it is ordered with the requests, reaches every tensor-parallel rank and is
  authorized by SGLang's `--api-key`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

ACTION_TYPE = "session_runtime.chain"
ACTION_VERSION = "2"
COMMAND_TYPE = "session_runtime.command"
COMMAND_VERSION = "1"
PROTOCOL_VERSION = "1"
# meta_info keys the tree's answers come back under (radix_ext/sglang/report.py)
REPORT_KEY = "session_runtime"  # a request-level meta_info key (radix_ext/sglang/report.py)
MAX_PROBES = 4
# Commands a step may carry for its conversation, run at its intake before it
# (the previous step's close or tool wait, sent after that step answered).
RIDING = frozenset({"close", "wait"})
MAX_RIDING = 8

_FIELDS = {"hold", "cache_limit", "promote", "share", "probes", "holder", "lease_s", "before"}


@dataclass(frozen=True)
class ChainIntent:
    """What the tree does with a request of a conversation.

    `hold`: lock the finished sequence as the owner's chain (False: lock
    nothing, as plain SGLang). `cache_limit`: insert at most this many leading
    tokens (the step's prompt, as SGLang's --strip-thinking-cache; forced
    output is part of SGLang's input, so the tree cannot tell it apart by
    itself); None inserts everything computed. `promote`: bring the owner's
    host copy back before the request is matched (`share`: else another
    conversation's that the prompt continues). `probes`: prompts, each as
    (tokens shared with this request's input, tokens after them), whose
    reusable prefix the tree reports as it is at intake. `holder`, `lease_s`:
    the chain is held under that runtime's lease (`leases.py`; 0: none).
    `before`: commands of RIDING, each (name, args), that the tree runs at
    intake first, in order (`backends/sglang/after.py`)."""

    hold: bool = True
    cache_limit: Optional[int] = None
    promote: bool = False
    share: bool = False
    probes: tuple = ()
    holder: Optional[str] = None
    lease_s: float = 0.0
    before: tuple = ()

    def envelope(self, message_id: str) -> dict:
        """The JSON `kv_hints` value for a /generate request."""
        payload: dict = {"hold": self.hold, "cache_limit": self.cache_limit}
        if self.promote:
            payload.update(promote=True, share=self.share)
        if self.probes:
            payload["probes"] = [[shared, list(tail)] for shared, tail in self.probes]
        if self.holder:
            payload.update(holder=self.holder, lease_s=self.lease_s)
        if self.before:
            payload["before"] = [{"cmd": name, "args": args} for name, args in self.before]
        return _envelope(message_id, "chain", ACTION_TYPE, ACTION_VERSION, payload)


NO_HOLD = ChainIntent(hold=False)  # a request without our action: plain SGLang, nothing held


def command_envelope(message_id: str, name: str, args: dict) -> dict:
    """`kv_hints` of a command request; it also caches nothing and holds nothing."""
    env = _envelope(message_id, "command", COMMAND_TYPE, COMMAND_VERSION, {"cmd": name, "args": args})
    env["actions"].append(ChainIntent(hold=False, cache_limit=0).envelope(message_id)["actions"][0])
    return env


def _envelope(message_id: str, action_id: str, action_type: str, version: str, payload: dict) -> dict:
    return {"protocol_version": PROTOCOL_VERSION, "message_id": message_id,
            "actions": [{"action_id": action_id, "action_type": action_type, "action_version": version,
                         "payload": payload}]}


def intent_of(kv_hints: Any) -> ChainIntent:
    """The request's ChainIntent: NO_HOLD when it carries none (a request with a
    `session_id` but without our hints holds nothing). A malformed payload of our
    action type is logged and ignored (the tree cannot refuse a request; the
    runtime validates what it sends)."""
    for action in _actions(kv_hints, ACTION_TYPE):
        parsed = _parse(action.action_version, action.payload)
        if parsed is not None:
            return parsed
        logger.warning("ignoring malformed %s action %r", ACTION_TYPE, action)
    return NO_HOLD


def command_of(kv_hints: Any) -> Optional[tuple[Any, Any]]:
    """(name, args) of the request's command action, unchecked; None when it has none."""
    for action in _actions(kv_hints, COMMAND_TYPE):
        payload = action.payload if isinstance(action.payload, dict) else {}
        return (payload.get("cmd") if action.action_version == COMMAND_VERSION else None), payload.get("args", {})
    return None


def _actions(kv_hints: Any, action_type: str):
    return [a for a in (getattr(kv_hints, "actions", ()) or ()) if a.action_type == action_type]


def _parse(version: str, payload: Any) -> Optional[ChainIntent]:
    if version != ACTION_VERSION or not isinstance(payload, dict) or set(payload) - _FIELDS:
        return None
    hold, limit = payload.get("hold", True), payload.get("cache_limit")
    promote, share = payload.get("promote", False), payload.get("share", False)
    probes = payload.get("probes", [])
    holder, lease = payload.get("holder"), payload.get("lease_s", 0.0)
    if not all(isinstance(b, bool) for b in (hold, promote, share)):
        return None
    if not (holder is None or isinstance(holder, str) and 0 < len(holder) <= 128):
        return None
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not 0 <= lease <= 86400:
        return None
    if not (limit is None or type(limit) is int and limit >= 0):
        return None
    if not isinstance(probes, list) or len(probes) > MAX_PROBES or not all(_probe_ok(p) for p in probes):
        return None
    before = payload.get("before", [])
    if not isinstance(before, list) or len(before) > MAX_RIDING or not all(
            isinstance(c, dict) and set(c) == {"cmd", "args"} and c["cmd"] in RIDING and isinstance(c["args"], dict)
            for c in before):
        return None
    return ChainIntent(hold=hold, cache_limit=limit, promote=promote, share=share,
                       probes=tuple((p[0], tuple(p[1])) for p in probes), holder=holder, lease_s=float(lease),
                       before=tuple((c["cmd"], c["args"]) for c in before))


def _probe_ok(p: Any) -> bool:
    return (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0 and isinstance(p[1], list)
            and all(type(t) is int and t >= 0 for t in p[1]))


def has_chain_action(kv_hints: Any) -> bool:
    """Does the request carry our chain action (a runtime's step)? Only such a
    request's `session_id` moves a chain."""
    return bool(_actions(kv_hints, ACTION_TYPE))
