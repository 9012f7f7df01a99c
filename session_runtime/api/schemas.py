"""Request bodies. Pydantic lives here, at the HTTP edge only."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from session_runtime.constrained import wire


class ForcedCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: dict = Field(default_factory=dict)


class Forced(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ForcedCall] = Field(default_factory=list)


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system: Optional[str] = None
    tools: Optional[list[dict]] = None
    tenant: Optional[str] = None
    policy: Optional[Literal["keep", "drop", "keep_last_k", "auto", "engine_default", "strip_thinking_cache"]] = None
    keep_last_k: int = Field(default=1, ge=0)
    materialize: Literal["auto", "always", "never"] = "auto"
    template: Optional[Literal["deepseek", "qwen3", "hf"]] = None
    continue_probability: float = Field(default=0.8, ge=0.0, le=1.0)
    offload: Optional[Literal["never", "always", "ttl", "pressure", "discard"]] = None
    ttl_s: float = Field(default=2.0, ge=0.0)


class StepOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: Optional[int] = Field(default=None, ge=0)  # None: 64, or the server's limit if lower
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)  # with logprobs: the k most likely tokens at each position
    forced: Optional[Forced] = None
    stream: bool = False
    # What the output must be, in Chat Completions' words (constrained/wire.py).
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None
    stop: Optional[Union[str, list[str]]] = None
    reasoning_effort: Optional[str] = None

    def options(self) -> dict:
        """The runtime's step options. Raises InvalidRequest for a constraint it cannot read."""
        return {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "logprobs": self.logprobs, "top_logprobs": self.top_logprobs, "forced": self.forced.model_dump() if self.forced else None,
            "constraint": wire.chat(self.tool_choice, self.response_format, self.stop, self.reasoning_effort),
        }


class SendMessage(StepOptions):
    content: str = Field(min_length=1)


class ToolResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool_call_id: str
    content: str = ""


class SendToolResults(StepOptions):
    results: list[ToolResult] = Field(min_length=1)
