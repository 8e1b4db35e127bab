"""A plain decode step launched but not read yet (the asynchronous loops of `llm_engine` and
`speculative_loops`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.request import Request
from specdec.transfer import Readback


@dataclass(frozen=True, slots=True)
class Inflight:
    """A plain decode step launched but not read (asynchronous scheduling): its requests in
    batch order, their sampled tokens on the device, the asynchronous copy reading them (with
    each row's unusable flag) and the positions of its input tokens. A step of the speculation
    policy's plain arm also keeps their target features (drafters that read some; None
    otherwise) and the marks that measure its cost; a step of a joining visit, the features of
    every input to deliver."""

    requests: list[Request]
    token_ids: torch.Tensor
    readback: Readback
    plain_arm: bool = False
    starts: list[int] | None = None
    features: torch.Tensor | None = None
    started: torch.cuda.Event | float | None = None
    ended: torch.cuda.Event | float | None = None
    # A step of a joining visit (`SpeculativeLoops._step_join`): per input of a speculative
    # request, (request, position of its first token, [n, F] target features of its tokens),
    # handed to the drafter when the step is read.
    deliveries: list[tuple[Request, int, torch.Tensor]] | None = None
    # The logprobs read back with the tokens: per group of the step's requests asking for the
    # same number of top alternatives, (that number, their indices in `requests`).
    logprob_groups: list[tuple[int, list[int]]] | None = None
    # The prompt logprobs read back with the tokens: per chunk that asked for them, (request,
    # start, the wanted rows, their prompt tokens, the number of top ids).
    prompt_logprobs: list[tuple[Request, int, list[int], list[int], int]] | None = None
