"""A step of the overlapped loop launched but not read yet (`overlapped_loop`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.request import Request
from specdec.transfer import Readback


@dataclass(frozen=True, slots=True)
class Inflight:
    """A step of the overlapped loop launched but not read: its emitting requests in batch
    order, their sampled tokens on the device, the asynchronous copy reading them (with each
    row's unusable flag) and the positions of their last input tokens. A measured step of the
    speculation policy's plain arm keeps the marks that measure its cost; a step holding
    speculative requests, their target features for the feature log (a decode step's [B, F],
    row b that of requests[b]; a mixed step's chunks)."""

    requests: list[Request]
    token_ids: torch.Tensor
    readback: Readback
    measured: bool = False
    starts: list[int] | None = None
    features: torch.Tensor | None = None
    started: torch.cuda.Event | float | None = None
    ended: torch.cuda.Event | float | None = None
    # A mixed step's: per input of a speculative request, (request, position of its first
    # token, [n, F] target features of its tokens), to the feature log when the step is read.
    chunks: list[tuple[Request, int, torch.Tensor]] | None = None
    # The logprobs read back with the tokens: per group of the step's requests asking for the
    # same number of top alternatives, (that number, their indices in `requests`).
    logprob_groups: list[tuple[int, list[int]]] | None = None
    # The prompt logprobs read back with the tokens: per chunk that asked for them, (request,
    # start, the wanted rows, their prompt tokens, the number of top ids).
    prompt_logprobs: list[tuple[Request, int, list[int], list[int], int]] | None = None
