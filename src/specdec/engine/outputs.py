"""What the engine returns, in vLLM's shape: `RequestOutput` with `CompletionOutput`s.

Plain data: no tensors, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """vLLM's `Logprob`: one token's log-probability under the raw target logits, its rank
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the top `logprobs` ids in rank order, then the generated token if it is
# not among them (vLLM's shape).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: the same for the prompt token; None for the first, which has no context.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: which of the request's n samples this is.
        text: the generated text (stop strings removed unless asked to keep them).
        token_ids: the generated token ids.
        finish_reason: "stop", "length", "abort", "error", or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated token, when SamplingParams.logprobs is set: token id ->
            `Logprob` for the top `logprobs` ids (rank order) and the generated token.
        cumulative_logprob: sum of the tokens' log-probabilities, when logprobs are computed.
        error: with finish_reason "error", the one line saying why the engine ended the
            sequence (the tokens before it stay emitted); None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    error: str | None = None

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
        prompt_logprobs: per prompt token (None for the first), when
            SamplingParams.prompt_logprobs is set; the same shape as `logprobs`.
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
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class SampleDelta:
    """What one sample gained since its previous delta (`RequestDelta`).

    Attributes:
        index: which of the request's n samples this is.
        keep: characters of the previously sent text that stay (all of them, unless a stop
            string cut the text back: then 0 and `text` is the whole text).
        text: the text appended after them.
        token_ids: the token ids appended.
        logprobs: the logprob entries appended (None: the request asks for none).
        finish_reason, stop_reason, cumulative_logprob, error: as `CompletionOutput`'s now.
    """

    index: int
    keep: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    cumulative_logprob: float | None
    error: str | None


@dataclass(slots=True)
class RequestDelta:
    """A request's output as a change since its previous delta (what `specdec serve`'s engine
    process sends; `LLMEngine.emit_deltas`): its samples' deltas, the prompt logprobs in the
    first delta only, the spec-decode counters in the finished one only (None before)."""

    request_id: str
    prompt: str | None
    finished: bool
    seed: int
    spec_decode_stats: dict | None
    prompt_logprobs: PromptLogprobs | None
    samples: list[SampleDelta]
