"""The inputs of one chain step of the EAGLE head inside a device round, as device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HeadStepInputs:
    """A chain head step's inputs as device tensors, one row per slot (a device round's):
    `positions` [S] is both each entry's RoPE position and its context length after the step
    (entry t sits at position t + 1 and is the context's last); `slots` [S] its cache slot (-1
    for inert slots, whose positions and query_lens are 0); `tokens` [S] the drafts it feeds;
    `hidden` [S, D] the previous head outputs; `tables` [S, max_blocks] the head's block tables.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    query_lens: torch.Tensor
    tokens: torch.Tensor
    hidden: torch.Tensor
    tables: torch.Tensor
