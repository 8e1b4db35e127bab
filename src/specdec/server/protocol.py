"""The OpenAI wire format: pydantic models of the requests (OpenAI's fields plus vLLM's `top_k`,
`min_p`, `ignore_eos` and specdec's per-request `speculative`) and of the error body.

Shapes only: limits that depend on the server's settings are checked in `specdec.server.app`.
Requests are validated strictly ("5" is not an integer); unknown fields are ignored, as OpenAI's
clients send some (`user`, penalties at their defaults) that do not change sampling here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class SpeculativeOverride(_Strict):
    """Per-request speculation; absent fields follow the server's `--speculative-config`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    enabled: StrictBool = True
    num_speculative_tokens: StrictInt | None = None
    method: Literal["standard", "block", "coupled"] | None = None

    def as_engine_dict(self) -> dict:
        """The `speculative` argument of `LLMEngine.add_request`."""
        values = self.model_dump(exclude_none=True)
        return values


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: StrictBool = False
    speculative: SpeculativeOverride | None = None


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`: one prompt (text, token ids, or a list holding one of them)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0)
    echo: StrictBool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo
