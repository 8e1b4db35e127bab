"""Medusa trees from the heads' top-k (Cai et al. 2024, "Medusa", section 2.1.2): the shared
tree-growing steps of `drafters.tree`, each node's children proposed by the head of their depth.

Every head reads only the target's hidden state at A - 2, never a draft, so the children of any
node at depth d - 1 (the root's: d = 0) come from head d's distribution of the token at
Q = A + d, whatever the node's token. The tree grows as the EAGLE and draft-model trees do (the
frontier nodes of highest cumulative draft log-probability get `topk` children; greedy requests
best-first), no deeper than the heads reach. Children are drawn through `draw_children`
(`Drafter.sample_draft`, each node its own key, siblings without replacement), so each node's
recorded distribution is its head's processed one without the earlier siblings' tokens: the one
it was drawn from. A greedy drafter takes each head's top tokens instead (Medusa's top-k
candidates: one-hot drafts, which the tree verifiers take as deterministic). Static choice
lists (Medusa's `medusa_choices`) are not read. Never draws noise itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specdec.drafters.tree import draw_level, expand_frontier, start_trees, tree_layout
from specdec.transfer import to_device

if TYPE_CHECKING:
    from specdec.drafters.base import DraftBatch, Drafter, ProposalBuffer
    from specdec.drafters.config import TreeConfig


def propose_medusa_tree(
    drafter: Drafter,
    batch: DraftBatch,
    tree: TreeConfig,
    live: list[int],
    hidden: torch.Tensor,
    out: ProposalBuffer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grows one tree per live request into `out` ([B, N] columns in node order).

    Args:
        drafter: the `medusa.MedusaDrafter` calling (its `heads`, and `sample_draft`; typed as
            the base class so that this module does not import the one that imports it).
        batch: the round's batch; num_draft[b] is request b's node budget (<= tree.nodes).
        tree: the tree settings (its depth capped at the number of heads).
        live: requests with a hidden state to draft from, in `hidden`'s row order (host).
        hidden: [len(live), D] each live request's target hidden state at A - 2, after the
            target's final norm.
        out: the round's proposal buffers, [B, N] wide.

    Returns:
        (parents [B, N] int64 with -1 beyond a request's nodes, num_nodes [B] int64), host.

    RNG: `sample_draft` with tree keys per drawn node (none for a greedy drafter or for
    temperature-0 requests).
    """
    size, width = batch.batch_size, out.draft_token_ids.shape[1]
    depth = min(tree.depth, drafter.heads.config.num_heads)
    tree = dataclasses.replace(tree, depth=depth)
    # [len(live), depth, V_draft]: head d's logits of each live request's token at A + d.
    head_logits = torch.stack([drafter.heads(hidden, d) for d in range(depth)], dim=1)
    row_of = {b: j for j, b in enumerate(live)}
    trees = start_trees(batch, tree, live)
    parents_rows = [(b, -1) for b in live]
    for level in range(depth):
        if not parents_rows:
            break
        # The children of (b, node) are head depth[node] + 1's (the root's: head 0's).
        rows = [row_of[b] for b, _ in parents_rows]
        heads = [0 if n < 0 else trees[b].depths[n] + 1 for b, n in parents_rows]
        index = to_device(rows + heads, torch.int64, head_logits.device).view(2, -1)
        logits = head_logits[index[0], index[1]]  # [len(parents_rows), V_draft]
        draw_level(drafter, batch, trees, parents_rows, logits, None, level, tree, out)
        if level + 1 == depth:
            break
        # A best-first step may offer nodes of any depth: those at the last head's have none.
        frontier = expand_frontier(trees, level, tree.topk)
        parents_rows = [(b, n) for b, n in frontier if trees[b].depths[n] + 1 < depth]
    return tree_layout(trees, size, width)
