"""The sampler's tensor-level types: per-row sampling parameters as tensors (`SamplingTensors`)
and what `sample` returns (`SampleOutput`). Shared by the sampler, its Triton twin and the
verifiers; nothing here samples or draws randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling.processing import RowParam, check_sampling_tensors, row_param


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """What `sample` returns.

    Attributes:
        token_ids: [N] int64 sampled token ids.
        processed_logits: [N, V] float32 logits actually sampled from (-inf outside the support);
            pass these as `draft_logits` to `verify` when the samples are drafts.
        logsumexp: [N] float32 log-normaliser of `processed_logits` (the draft's, for `verify`'s
            `draft_logsumexp`, which then need not re-read the draft logits to normalise them).
    """

    token_ids: torch.Tensor
    processed_logits: torch.Tensor
    logsumexp: torch.Tensor


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors on the logits' device ([N] each)."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor | None  # [N] int64
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32

    @staticmethod
    def build(
        num_rows: int,
        device: torch.device,
        temperature: RowParam,
        top_k: RowParam = None,
        top_p: RowParam = None,
        min_p: RowParam = None,
        *,
        check: bool = True,
    ) -> SamplingTensors:
        """Per-row tensors of the parameters; `check=False` leaves the value checks to the
        caller (who folds them into one device sync with `sampling_violations`)."""
        if temperature is None:
            raise ValueError("temperature is required (0 for greedy)")
        tensors = SamplingTensors(
            temperature=row_param(temperature, num_rows, torch.float32, device, "temperature"),
            top_k=row_param(top_k, num_rows, torch.int64, device, "top_k"),
            top_p=row_param(top_p, num_rows, torch.float32, device, "top_p"),
            min_p=row_param(min_p, num_rows, torch.float32, device, "min_p"),
        )
        if check:
            check_sampling_tensors(tensors.temperature, tensors.top_k, tensors.top_p, tensors.min_p)
        return tensors

    def repeat_interleave(self, repeats: int) -> SamplingTensors:
        """Each row's parameters repeated `repeats` times (one request -> its K+1 verify rows)."""

        def rep(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat_interleave(repeats)

        return SamplingTensors(
            rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p)
        )
