"""Per-request constants of a batch (seeds, sampling parameters) as tensors on a device, kept
while the batch keeps the same requests in the same order, so a step copies them to the device
only when the batch changes. Builds tensors only; never samples or draws randomness.
"""

from __future__ import annotations

import torch

from specdec.engine.request import Request
from specdec.sampling import SamplingParams, SamplingTensors
from specdec.transfer import to_device


class BatchConstants:
    """The seeds and sampling parameters of a batch of requests, as tensors on `device`.

    They are fixed per request, so `ConstantsCache` keeps them while the same requests come in the
    same order instead of rebuilding them (and copying them to the device) at every step. Each
    tensor is built on first use: an all-greedy batch of plain decoding never needs them.
    """

    __slots__ = ("_params", "_seeds", "device", "greedy", "requests")

    def __init__(self, requests: list[Request], device: torch.device) -> None:
        self.requests = requests
        self.device = device
        self.greedy = all(r.params.temperature == 0 for r in requests)
        self._seeds: torch.Tensor | None = None
        self._params: SamplingTensors | None = None

    @property
    def seeds(self) -> torch.Tensor:
        """[B] int64 request seeds."""
        if self._seeds is None:
            self._seeds = to_device([r.seed for r in self.requests], torch.int64, self.device)
        return self._seeds

    @property
    def params(self) -> SamplingTensors:
        """[B] sampling parameters (see `sampling_tensors`)."""
        if self._params is None:
            self._params = sampling_tensors([r.params for r in self.requests], self.device)
        return self._params


class ConstantsCache:
    """One `BatchConstants` per purpose ("plain", "draft" or a verify method)."""

    def __init__(self) -> None:
        self._cached: dict[str, BatchConstants] = {}

    def get(self, purpose: str, requests: list[Request], device: torch.device) -> BatchConstants:
        """The constants of `requests` for `purpose`: the cached ones while the batch keeps the
        same requests in the same order, else new ones."""
        cached = self._cached.get(purpose)
        if cached is None or cached.device != device or cached.requests != requests:
            cached = self._cached[purpose] = BatchConstants(requests, device)
        return cached


def sampling_tensors(params: list[SamplingParams], device: torch.device) -> SamplingTensors:
    """[B] tensors of the requests' sampling parameters; a filter that no request uses is None."""

    def column(values, dtype, off):
        if all(v == off for v in values):
            return None
        return to_device(values, dtype, device)

    return SamplingTensors(
        temperature=to_device([p.temperature for p in params], torch.float32, device),
        top_k=column([p.top_k for p in params], torch.int64, 0),
        top_p=column([p.top_p for p in params], torch.float32, 1.0),
        min_p=column([p.min_p for p in params], torch.float32, 0.0),
    )
