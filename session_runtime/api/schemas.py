"""Request bodies. Pydantic lives here, at the HTTP edge only."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class Forced(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reasoning: str = ""
    content: str = ""


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system: Optional[str] = None
    tenant: Optional[str] = None


class SendMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = Field(min_length=1)
    max_tokens: int = Field(default=64, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    seed: Optional[int] = None
    logprobs: bool = False
    forced: Optional[Forced] = None
