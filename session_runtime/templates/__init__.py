"""Chat templates that render messages to token ids with typed spans.

May import the tokenizer and the core helpers only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from session_runtime.templates.base import Message, ParsedOutput, Rendered, Span, Template, ToolCall
from session_runtime.templates.deepseek import DeepSeekTemplate

__all__ = ["Message", "ParsedOutput", "Rendered", "Span", "Template", "ToolCall", "DeepSeekTemplate", "auto_template",
           "build_template"]

# sha256 of the official chat templates our built-in templates implement, as
# model folders ship them (Qwen3's: tests/data/qwen3_chat_template.jinja).
OFFICIAL_TEMPLATES = {"87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": "qwen3"}


def auto_template(model: str, tokenizer) -> str:
    """`--template auto`: for a folder with a chat template, the built-in template
    whose official text it is, else `hf`; without one, qwen3 for Qwen's tokenizer
    and deepseek otherwise."""
    import hashlib

    from session_runtime.templates.official import read_chat_template

    text = read_chat_template(Path(model)) if Path(model).is_dir() else None
    if text is not None:
        return OFFICIAL_TEMPLATES.get(hashlib.sha256(text.encode()).hexdigest(), "hf")
    return "qwen3" if tokenizer.inner.token_to_id("<|im_start|>") is not None else "deepseek"


def build_template(name: str, tokenizer, folder: Optional[str] = None) -> Template:
    """Raises InvalidRequest for an unknown template name, or `hf` without a
    model folder that has a chat template."""
    from session_runtime.errors import InvalidRequest

    if name == "deepseek":
        return DeepSeekTemplate(tokenizer)
    if name == "qwen3":
        from session_runtime.templates.qwen3 import Qwen3Template

        return Qwen3Template(tokenizer)
    if name == "hf":
        from session_runtime.templates.hf import HFTemplate

        if folder is None or not Path(folder).is_dir():
            raise InvalidRequest("template 'hf' renders a model folder's own chat template: give --model a folder")
        return HFTemplate(tokenizer, Path(folder))
    raise InvalidRequest(f"unknown template {name!r}: deepseek, qwen3 or hf")
