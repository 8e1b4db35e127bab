"""The inputs of one EAGLE head step inside a device round, as device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HeadStepInputs:
    """A head step's inputs as device tensors over S slots (a device round's), W entries a slot
    (the catch-up: the round's width; a chain step: 1), handed to the head directly instead of
    being copied into its static buffers (a round is one graph, so its steps need no static
    inputs of their own).

    Attributes:
        slots: [S * W] cache slot of each entry (-1 for entries that are not fed).
        positions: [S * W] each entry's RoPE position t + 1 (entry t; 0 when not fed).
        context_lens: [S] the head cache's length after the step (0 for inert slots).
        query_lens: [S] entries fed per slot.
        tokens: [S * W] the token at each entry's position.
        tables: [S, max_blocks] the head's block tables.
        hidden: [S, D] the previous head outputs (a chain step), or None.
        features: [S * W, F] the target features of the entries (the catch-up), or None.
        ends: [S] row of each slot's last fed entry (the catch-up), or None.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    tokens: torch.Tensor
    tables: torch.Tensor
    hidden: torch.Tensor | None = None
    features: torch.Tensor | None = None
    ends: torch.Tensor | None = None
