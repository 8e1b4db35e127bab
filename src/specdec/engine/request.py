"""A request's state as the scheduler sees it: tokens, KV accounting, speculation settings.

Pure bookkeeping (no tensors, no randomness); the seed is fixed at admission.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.drafters.config import DEFAULT_REJECTION_SAMPLE_METHOD
from specdec.engine.detokenize import IncrementalText
from specdec.metrics import SpecDecodeStats
from specdec.sampling.context import LogitsContext, LogitsRules
from specdec.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specdec.sampling.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine ended it (vLLM's FinishReason.ERROR): see its error

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """Per-request speculation: how many drafts per round and how they are verified."""

    num_speculative_tokens: int
    method: str = DEFAULT_REJECTION_SAMPLE_METHOD


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Attributes:
        request_id: caller's id.
        prompt_token_ids: the prompt.
        params: sampling settings.
        seed: the signed 64-bit seed every draw of this request is keyed by.
        spec: speculation settings, or None to decode without drafts.
        output_token_ids: tokens emitted so far.
        num_computed_tokens: tokens whose K/V are in the cache (a prefix of all tokens).
        block_ids: KV cache blocks held, in order.
        stats: spec-decode counters of this request.
        detokenized: the incremental text of output_token_ids (see `specdec.engine.detokenize`).
        num_pending: tokens sampled on the device but not read yet (asynchronous scheduling);
            they count in num_tokens, not in output_token_ids.
        rules: penalties, biases and bans resolved to token ids (None: none).
        grammar: the structured-output constraint's matcher, following output_token_ids
            (None: unconstrained).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    spec: SpecSettings | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_preemptions: int = 0
    detokenized: IncrementalText = field(default_factory=IncrementalText)
    num_pending: int = 0
    rules: LogitsRules | None = None
    grammar: GrammarMatcher | None = None

    @property
    def host_processed(self) -> bool:
        """Its logits are processed with its output so far (rules or a grammar): the steps
        that sample it build the rules' tensors from its output on the host (device rounds
        keep them in its slot instead, `SlotRules`; a grammar always runs on the host)."""
        return self.rules is not None or self.grammar is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token (the input token of the next decode round); no list copy."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        """True while tokens other than the last one still lack K/V (prompt or recompute)."""
        return self.num_computed_tokens < self.num_tokens - 1


def logits_context(requests: list[Request]) -> LogitsContext | None:
    """The penalties, biases, bans and grammars of `requests` with their contexts (None: none
    has any)."""
    if not any(r.host_processed for r in requests):
        return None
    return LogitsContext(
        [r.rules for r in requests],
        [r.prompt_token_ids for r in requests],
        [r.output_token_ids for r in requests],
        # a finished request's row emits nothing (the overlapped loop samples it once more)
        [None if r.status.finished else r.grammar for r in requests],
    )
