"""Provider protocol adapters: each parses a protocol's request and response
bodies into the canonical history (canonical.py), renders them back byte for
byte, strips historical reasoning on the way out by that provider's rules and
validates a request as the provider would.

`get_protocol(name)` returns the adapter; each is imported only when asked for.

May import only the weak memo (weak_memo.py): the protocols sit below
everything that speaks them.
"""

from __future__ import annotations

import importlib

from session_runtime.protocols.base import (
    PASSTHROUGH_ENV, ChatProtocol, ProtocolError, ProtocolInputError, StripOptions, StripResult, passthrough_from_env,
)

__all__ = ["NAMES", "PASSTHROUGH_ENV", "ChatProtocol", "ProtocolError", "ProtocolInputError", "StripOptions",
           "StripResult", "get_protocol", "passthrough_from_env"]

# name -> (module, class); modules are imported lazily by get_protocol.
_REGISTRY = {
    "deepseek": ("session_runtime.protocols.deepseek", "DeepSeek"),
    "openai-chat": ("session_runtime.protocols.openai_chat", "OpenAIChat"),
    "openai-responses": ("session_runtime.protocols.openai_responses", "OpenAIResponses"),
    "anthropic": ("session_runtime.protocols.anthropic", "Anthropic"),
    "gemini": ("session_runtime.protocols.gemini", "Gemini"),
}
NAMES = tuple(_REGISTRY)


def get_protocol(name: str) -> ChatProtocol:
    """The adapter of protocol `name`: deepseek, openai-chat, openai-responses
    anthropic or gemini. Raises ValueError for any other name."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown protocol {name!r}; one of {', '.join(NAMES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)()
