"""The OpenAI wire format: pydantic models of the requests (OpenAI's fields, vLLM's extra
sampling fields and specdec's per-request `speculative`) and of the error body.

Shapes only: limits that depend on the server's settings are checked in `specdec.server.app`.
Requests are validated strictly ("5" is not an integer), and a field this server does not
implement is refused by name (a 400), never silently dropped: OpenAI's clients send only the
fields a caller set. `user` is accepted and ignored (it labels the caller, it changes nothing).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from specdec.sampling.structured import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class SpeculativeOverride(_Strict):
    """Per-request speculation; absent fields follow the server's `--speculative-config`. The
    drafter (`speculative_config.method`) is the server's; a request picks the verifier."""

    enabled: StrictBool = True
    num_speculative_tokens: StrictInt | None = None
    rejection_sample_method: Literal["standard", "block", "coupled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _renamed_method(cls, values: Any) -> Any:
        if isinstance(values, dict) and "method" in values:
            raise ValueError(
                "speculative.method is not a per-request setting: the verifier is "
                '"rejection_sample_method" (standard, block or coupled); "method" names the '
                "drafter, which is the server's --speculative-config"
            )
        return values

    def as_engine_dict(self) -> dict:
        """The `speculative` argument of `LLMEngine.add_request`."""
        values = self.model_dump(exclude_none=True)
        return values


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. The schema is always enforced (as with
    `strict: true`); `name` and `description` only label it."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: "text", "json_object" (any JSON object) or "json_schema"."""

    type: StrictStr
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in ("text", "json_object", "json_schema"):
            raise ValueError(
                f"response_format type {value!r} is not supported; use text, json_object or "
                "json_schema"
            )
        return value

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format needs json_schema exactly when type is "json_schema"')
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema or {})
        return None


# The request fields that may carry a structured-output constraint (at most one per request).
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


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
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[StrictStr, float] | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[StrictStr, Any] | None = None
    guided_json: dict[StrictStr, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    user: StrictStr | None = None
    speculative: SpeculativeOverride | None = None

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the request's structured-output constraint or None, the field that gave it).

        Raises:
            ValueError: several fields ask for a constraint, or one is malformed.
        """
        given: list[tuple[str, StructuredOutputsParams]] = []
        if self.response_format is not None and self.response_format.constraint() is not None:
            given.append(("response_format", self.response_format.constraint()))
        if self.structured_outputs is not None:
            given.append(
                ("structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
            )
        for name, field in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                given.append((name, StructuredOutputsParams(**{field: value})))
        if len(given) > 1:
            names = [name for name, _ in given]
            raise ValueError(f"several structured-output constraints given ({names}); give one")
        return (given[0][1], given[0][0]) if given else (None, None)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            bad = [key for key in value if not key.strip().isdigit()]
            if bad:
                raise ValueError(f"logit_bias keys must be token ids, got {bad[:3]}")
        return value


def split_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four shapes of `prompt` as a list of prompts, each a string or token ids.

    A string is one prompt; a list of strings is several; a list of integers is one prompt of
    token ids; a list of integer lists is several. Emptiness of a single prompt is left to the
    server (an empty string may still encode to a BOS token).

    Raises:
        ValueError: an empty list, a list mixing those shapes, or any other type.
    """
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise ValueError(f"prompt must be {shapes}, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt is an empty list")
    if all(_is_token_id(item) for item in prompt):
        return [list(prompt)]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(isinstance(item, list) for item in prompt):
        for index, token_ids in enumerate(prompt):
            if not all(_is_token_id(item) for item in token_ids):
                raise ValueError(f"prompt[{index}] must be a list of integer token ids")
        return [list(token_ids) for token_ids in prompt]
    raise ValueError(f"prompt must be {shapes}; its items mix types")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`.

    `prompt` arrives in any of OpenAI's four shapes and is held as a list of prompts
    (`split_prompts`); each prompt runs with `n` samples and its choices are numbered
    prompt-major: choice `prompt_index * n + sample_index`.
    """

    prompt: list[StrictStr | list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _split_prompt(cls, value: Any) -> list[str | list[int]]:
        return split_prompts(value)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None


class TokenizeRequest(_Strict):
    """`POST /tokenize` (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    """`POST /detokenize` (vLLM's)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo
