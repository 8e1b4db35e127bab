"""Drawing a draft tree's children: the per-level step every tree drafter shares.

Children of one parent are drawn one sibling rank at a time through `Drafter.sample_draft`, each
row keyed by its own node index and excluding the tokens its earlier siblings took (sampling
without replacement: every sibling is a distinct token, and each child's recorded distribution is
the one it was drawn from, which is what exact multi-draft verification needs). Greedy drafters
take the top tokens instead. Never draws noise itself and never verifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.drafters.base import DraftBatch, Drafter


@dataclass(frozen=True, slots=True)
class Children:
    """Attributes:
    token_ids: [M, C] int64 target ids of each parent's children (-1 where none).
    draft_logits: [M, C, V_target] float32 processed logits each child was drawn from (-inf
        rows where none), or None for a greedy drafter (one-hot children).
    """

    token_ids: torch.Tensor
    draft_logits: torch.Tensor | None


def draw_children(
    drafter: Drafter,
    logits: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    batch: DraftBatch,
    nodes: torch.Tensor,
) -> Children:
    """Draws the children of M parents from the draft logits after each parent.

    Args:
        drafter: the drafter (its `sample_draft` owns the noise; `greedy` takes the top tokens).
        logits: [M, V_draft] raw draft logits of the token after each parent.
        rows: [M] int64 request index (into `batch`) of each parent, on the host.
        positions: [M] int64 position Q of the children's tokens.
        batch: the round's batch.
        nodes: [M, C] int64 tree node index of each parent's i-th child (-1: no such child; a
            parent's children come first, then nothing), on the host.

    Returns:
        Children(token_ids [M, C], draft_logits [M, C, V_target] or None).

    RNG: as `Drafter.sample_draft` with tree keys, one Gumbel field per child (none when
    greedy).
    """
    num_parents, width = nodes.shape
    device = logits.device
    vocab = drafter.target_vocab_size
    tokens = torch.full((num_parents, width), -1, dtype=torch.int64, device=device)
    if drafter.greedy:
        full = drafter.to_target_vocab(logits)
        top = full.topk(min(width, vocab), dim=-1).indices  # [M, min(C, V)]
        tokens[:, : top.shape[1]] = top
        tokens = torch.where(nodes.to(device) >= 0, tokens, -1)
        return Children(tokens, None)
    processed = torch.full((num_parents, width, vocab), float("-inf"), device=device)
    positions = positions.to(torch.int64)
    for rank in range(width):
        picked = (nodes[:, rank] >= 0).nonzero().squeeze(1)  # host
        if picked.numel() == 0:
            break
        on = picked.to(device)
        out = drafter.sample_draft(
            logits[on],
            rows[picked],
            positions[picked.to(positions.device)],
            batch,
            tree_nodes=nodes[picked, rank],
            tree_ranks=torch.full((picked.numel(),), rank, dtype=torch.int64),
            exclude=tokens[on, :rank],
        )
        tokens[on, rank] = out.token_ids
        processed[on, rank] = out.processed_logits
    return Children(tokens, processed)
