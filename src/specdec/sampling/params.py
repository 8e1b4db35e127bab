"""SamplingParams: the per-request sampling settings, with vLLM's field names and defaults.

Validates on construction; it never touches tensors or draws randomness.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from specdec.sampling.structured import StructuredOutputsParams

# Below this a temperature means greedy decoding (vLLM's convention).
GREEDY_TEMPERATURE_EPS = 1e-5
# Between GREEDY_TEMPERATURE_EPS and this, logits / T overflow float32 easily; vLLM clamps too.
MIN_SAMPLED_TEMPERATURE = 1e-2
# vLLM clamps logit_bias values to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
MAX_LOGIT_BIAS = 100.0


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings for one request.

    Attributes:
        n: number of output sequences for the prompt.
        temperature: 0 means greedy; must be >= 0.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 (or -1, as in vLLM) disables.
        min_p: keep tokens with probability >= min_p * max probability; in [0, 1]; 0 disables.
        seed: 64-bit request seed; None draws a fresh one at admission (recorded in the output).
        max_tokens: maximum number of generated tokens (>= 1), or None for up to max_model_len.
        min_tokens: before this many tokens, EOS (unless ignored) and stop_token_ids are never
            sampled (vLLM's rule) and stop strings are not honoured.
        stop: strings that end generation (not included in the output unless asked).
        stop_token_ids: token ids that end generation.
        ignore_eos: keep generating after EOS.
        logprobs: number of top log-probabilities to return per token (None: none; 0: only the
            sampled token's).
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the matched stop string in the text.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already in the
            output (OpenAI's definition; 0 disables).
        frequency_penalty: in [-2, 2]; times a token's count in the output, subtracted from its
            logit (0 disables).
        repetition_penalty: > 0; tokens of the prompt or the output have positive logits
            divided by it and negative ones multiplied by it (1 disables).
        logit_bias: token id -> bias added to its logit, clamped to [-100, 100] (vLLM's rule).
        bad_words: words that must not be generated (tokenized as vLLM does).
        allowed_token_ids: only these token ids may be generated.
        prompt_logprobs: number of top log-probabilities to return per prompt token (None:
            none; 0: only the prompt token's).
        best_of: not supported beyond `n` (None or n); sampling more and keeping the best is
            refused rather than silently ignored.
        structured_outputs: a constraint on the output (JSON schema, any JSON object, regex,
            choice, grammar), applied after the penalties and bans; None: none.

    Penalties, biases and bans are applied to the raw logits before temperature and the filters
    (vLLM's order: allowed_token_ids, bad_words, min_tokens, logit_bias, repetition, frequency,
    presence); under speculation each verified position counts the drafts before it as output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= 0 (-1 also disables), got {self.top_k!r}"
            )
        if self.top_k == -1:
            self.top_k = 0
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not -(2**63) <= self.seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop}")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        self._check_context_rules()
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}"
            )
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise ValueError(
                f"best_of={self.best_of!r} is not supported (keeping the best of more samples "
                f"than are returned); ask for n={self.n} samples and leave best_of unset"
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_SAMPLED_TEMPERATURE:
            warnings.warn(
                f"temperature {self.temperature} is below {MIN_SAMPLED_TEMPERATURE}; clamped to it "
                "to keep logits / temperature finite",
                stacklevel=3,
            )
            self.temperature = MIN_SAMPLED_TEMPERATURE

    def _check_context_rules(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        value = self.repetition_penalty
        if not _is_real(value) or not 0.0 < value < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}"
                )
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.strip().isdigit():
                    token = int(token)  # JSON object keys are strings
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not _is_real(value) or math.isnan(value):
                    raise ValueError(f"logit_bias values must be numbers, got {value!r}")
                bias[token] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
            self.logit_bias = bias
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None and not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be token ids >= 0, got {ids!r}")
            self.allowed_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def seed64(self) -> int | None:
        """The seed as a signed 64-bit integer (the form the RNG takes), or None."""
        if self.seed is None:
            return None
        return self.seed - 2**64 if self.seed >= 2**63 else self.seed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
