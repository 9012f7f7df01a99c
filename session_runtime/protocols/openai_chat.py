"""OpenAI-compatible Chat Completions as vLLM and SGLang serve them.

Reasoning comes as `reasoning_content` (SGLang, older vLLM) or `reasoning`
(newer vLLM), sometimes both; either is read, and a message goes back with the
field names it came with. The outbound rule is DeepSeek's lenient one with no
strict shape: these servers render history through the model's chat template,
which drops reasoning before the last user message itself (Qwen3,
DeepSeek V3.2; PROTOCOLS.md sections 1 and 5).
"""

from __future__ import annotations

from typing import Optional

from session_runtime.protocols.base import ProtocolError
from session_runtime.protocols.chat import ChatCompletions


class OpenAIChat(ChatCompletions):
    name = "openai-chat"
    reasoning_fields = ("reasoning_content", "reasoning")
    cached_paths = (("prompt_tokens_details", "cached_tokens"),)

    def validate(self, body: dict) -> Optional[ProtocolError]:
        """Only the basic refusals: no reasoning rule is known for these servers."""
        return self.shape_error(body)

    def known_error(self, status: int, body: dict) -> Optional[str]:
        """None: PROTOCOLS.md lists no reasoning error for these servers."""
        return None
