"""Chat templates that render messages to token ids with typed spans."""

from __future__ import annotations

from session_runtime.templates.base import Message, ParsedOutput, Rendered, Span, Template, ToolCall
from session_runtime.templates.deepseek import DeepSeekTemplate

__all__ = ["Message", "ParsedOutput", "Rendered", "Span", "Template", "ToolCall", "DeepSeekTemplate", "build_template"]


def build_template(name: str, tokenizer) -> Template:
    """Raises InvalidRequest for an unknown template name."""
    from session_runtime.errors import InvalidRequest

    if name == "deepseek":
        return DeepSeekTemplate(tokenizer)
    if name == "qwen3":
        from session_runtime.templates.qwen3 import Qwen3Template

        return Qwen3Template(tokenizer)
    raise InvalidRequest(f"unknown template {name!r}: deepseek or qwen3")
