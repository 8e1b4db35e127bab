"""SamplingParams: the per-request sampling settings, with vLLM's field names and defaults.

Validates on construction; it never touches tensors or draws randomness.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

# Below this a temperature means greedy decoding (vLLM's convention).
GREEDY_TEMPERATURE_EPS = 1e-5
# Between GREEDY_TEMPERATURE_EPS and this, logits / T overflow float32 easily; vLLM clamps too.
MIN_SAMPLED_TEMPERATURE = 1e-2


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
        min_tokens: EOS and stop tokens are not honoured before this many tokens.
        stop: strings that end generation (not included in the output unless asked).
        stop_token_ids: token ids that end generation.
        ignore_eos: keep generating after EOS.
        logprobs: number of top log-probabilities to return per token (None: none; 0: only the
            sampled token's).
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the matched stop string in the text.
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
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_SAMPLED_TEMPERATURE:
            warnings.warn(
                f"temperature {self.temperature} is below {MIN_SAMPLED_TEMPERATURE}; clamped to it "
                "to keep logits / temperature finite",
                stacklevel=3,
            )
            self.temperature = MIN_SAMPLED_TEMPERATURE

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
