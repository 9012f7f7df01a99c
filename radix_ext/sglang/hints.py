"""Per-request intent carried in SGLang's versioned `kv_hints` envelope.

The runtime attaches one action of type `session_runtime.chain` to each step
it sends; the request's top-level `session_id` names the conversation (the
chain's owner). SGLang passes both to the tree unchanged (`Req.session_id`,
`Req.kv_hints`); consumers ignore action types they do not implement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

ACTION_TYPE = "session_runtime.chain"
ACTION_VERSION = "1"
PROTOCOL_VERSION = "1"


@dataclass(frozen=True)
class ChainIntent:
    """What the tree does with a request of a conversation.

    `hold`: lock the finished sequence as the owner's chain (False: lock
    nothing, as plain SGLang). `cache_limit`: insert at most this many leading
    tokens (the step's prompt, as SGLang's --strip-thinking-cache; forced
    output is part of SGLang's input, so the tree cannot tell it apart by
    itself); None inserts everything computed."""

    hold: bool = True
    cache_limit: Optional[int] = None

    def envelope(self, message_id: str) -> dict:
        """The JSON `kv_hints` value for a /generate request."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "message_id": message_id,
            "actions": [{
                "action_id": "chain",
                "action_type": ACTION_TYPE,
                "action_version": ACTION_VERSION,
                "payload": {"hold": self.hold, "cache_limit": self.cache_limit},
            }],
        }


def intent_of(kv_hints: Any) -> ChainIntent:
    """The request's ChainIntent: the default when it carries none. A malformed
    payload of our action type is logged and ignored (the tree cannot refuse a
    request; the runtime validates what it sends)."""
    if kv_hints is None:
        return ChainIntent()
    for action in getattr(kv_hints, "actions", ()) or ():
        if action.action_type != ACTION_TYPE:
            continue
        parsed = _parse(action.action_version, action.payload)
        if parsed is not None:
            return parsed
        logger.warning("ignoring malformed %s action %r", ACTION_TYPE, action)
    return ChainIntent()


def _parse(version: str, payload: Any) -> Optional[ChainIntent]:
    if version != ACTION_VERSION or not isinstance(payload, dict) or set(payload) - {"hold", "cache_limit"}:
        return None
    hold, limit = payload.get("hold", True), payload.get("cache_limit")
    if not isinstance(hold, bool) or not (limit is None or type(limit) is int and limit >= 0):
        return None
    return ChainIntent(hold=hold, cache_limit=limit)
