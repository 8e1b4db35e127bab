"""What the engine returns, in vLLM's shape: `RequestOutput` with `CompletionOutput`s.

Plain data: no tensors, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """One emitted token's log-probability and the top alternatives (raw target logits)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: which of the request's n samples this is.
        text: the generated text (stop strings removed unless asked to keep them).
        token_ids: the generated token ids.
        finish_reason: "stop", "length", "abort", or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated token, when SamplingParams.logprobs is set.
        cumulative_logprob: sum of the tokens' log-probabilities, when logprobs are computed.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Everything about one prompt's request.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text (None when given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: one CompletionOutput per sample (n of them).
        finished: whether every sample has finished.
        seed: the seed the request ran with (pass it back to replay the request).
        spec_decode_stats: per-request speculative-decoding counters (metrics.SpecDecodeStats
            as a dict), summed over its samples.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    seed: int
    spec_decode_stats: dict = field(default_factory=dict)
