"""Reasoning-aware session runtime on SGLang's RadixCache."""

from session_runtime.config import RuntimeConfig
from session_runtime.errors import (
    ContextTooLong,
    ConversationBusy,
    ConversationNotFound,
    InvalidRequest,
    PoolExhausted,
    ToolCallConflict,
)

__all__ = [
    "Runtime", "RuntimeConfig", "ConversationNotFound", "InvalidRequest", "ContextTooLong", "PoolExhausted",
    "ConversationBusy", "ToolCallConflict",
]


def __getattr__(name: str):
    # Importing Runtime pulls in SGLang (slow); load it on first use.
    if name == "Runtime":
        from session_runtime.runtime import Runtime

        return Runtime
    raise AttributeError(name)
