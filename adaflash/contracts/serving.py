"""Dataplane HTTP contract: OpenAI-compatible requests plus our ``usage.speculative``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adaflash.contracts.tenancy import TENANT_ID_PATTERN as TENANT_PATTERN  # noqa: F401 - one rule

TENANT_HEADER = "X-Tenant-ID"
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (constrained by a grammar)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object with a schema")
        return self


# OpenAI parameters this node does not implement: refused when set, never silently ignored.
UNSUPPORTED = ("logit_bias", "tools", "tool_choice", "functions", "function_call", "best_of", "suffix",
               "audio", "modalities", "prediction", "web_search_options", "logits_processors")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name in UNSUPPORTED:
                value = data.get(name)
                if value in (None, {}, []) or (name == "best_of" and value == 1):
                    continue
                raise ValueError(f"{name} is not supported by this node")
        return data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None
    domain: str | None = Field(default=None, max_length=64)  # optional tag carried into feedback
    ignore_eos: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties on tokens already emitted (verification runs on the penalised logits).
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.ignore_eos and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("ignore_eos cannot be combined with a JSON response_format (the grammar ends it)")
        return self

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
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: top alternatives
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this node")
        return v

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

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """OpenAI's content-part form: a list of {"type": "text", "text": ...}."""
        if isinstance(v, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in v):
                raise ValueError("only text content parts are supported")
            return "".join(p["text"] for p in v)
        return v


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name of max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
            self.max_tokens = self.max_completion_tokens
        return self

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


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``; ``drafter`` is ours (version, mode, manifest digest)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "adaflash"
    root: str | None = None
    max_model_len: int | None = None
    drafter: dict | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class DrafterLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1, max_length=128)
    uri: str = Field(min_length=1, max_length=2048)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")  # sha256 of manifest.json


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
