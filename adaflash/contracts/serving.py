"""Dataplane HTTP contract: OpenAI-compatible requests plus our ``usage.speculative``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adaflash.contracts.tenancy import TENANT_ID_PATTERN as TENANT_PATTERN  # noqa: F401 - one rule

TENANT_HEADER = "X-Tenant-ID"


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    domain: str | None = Field(default=None, max_length=64)  # optional tag carried into feedback
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 4 or any(not isinstance(s, str) or not s or len(s) > 64 for s in v):
            raise ValueError("stop must be up to 4 non-empty strings of at most 64 characters")
        return v


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("prompt must be a string or a list holding exactly one string")
            v = v[0]
        if not isinstance(v, str) or not v.strip():
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)

    @field_validator("messages")
    @classmethod
    def _nonempty(cls, v):
        if not any(m.content.strip() for m in v):
            raise ValueError("messages must carry some content")
        return v


class SpeculativeUsage(BaseModel):
    rounds: int
    draft_tokens: int
    verified_tokens: int
    accepted_tokens: int
    mean_accept_len: float
    mean_verify_len: float
    drafter_version: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage


class DrafterLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1, max_length=128)
    uri: str = Field(min_length=1, max_length=2048)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")  # sha256 of manifest.json


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
