"""Draft-model tree drafting (EAGLE-2 style dynamic trees, with the draft model in place of the
head): the shared tree-growing steps of `drafters.tree`, each level's logits from one tree step
of the draft model's runner.

After the round's catch-up step (the draft logits of the token at the anchor A), the root gets
the `topk` best children; then, level by level, the `topk` frontier nodes of highest cumulative
draft log-probability each get `topk` children, within the round's node budget. A level's logits
come from one tree step over [the last committed token, every node drawn so far]
(`StepInput.tree_parents`: node n at RoPE position A + depth[n], attending to the cached prefix
and to its ancestors only), whose rows of the nodes being expanded are read. The nodes' K/V go to
the draft cache's slots A .. A + n - 1 and are not kept: the draft state stays at the committed
tokens, so the next round's catch-up feeds the accepted path (and overwrites those slots).
Children are drawn through `draw_children` (`Drafter.sample_draft`): the tree's shape depends
only on nodes already drawn, which keeps multi-draft verification exact.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftBatch, Drafter, ProposalBuffer
from specdec.drafters.config import TreeConfig
from specdec.drafters.tree import draw_level, expand_frontier, start_trees, tree_layout
from specdec.runner import StepInput
from specdec.transfer import to_device


def propose_draft_model_tree(
    drafter: Drafter,
    batch: DraftBatch,
    tree: TreeConfig,
    states: list,
    logits: torch.Tensor,
    out: ProposalBuffer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grows one tree per request into `out` ([B, N] columns in node order).

    Args:
        drafter: the draft-model drafter (its runner, block size and `sample_draft`).
        batch: the round's batch; num_draft[b] is request b's node budget (<= tree.nodes).
        tree: the tree settings.
        states: per request, its draft state (`token_ids` = the committed tokens, with K/V;
            `block_ids` covering them and tree.nodes slots more).
        logits: [B, V] the catch-up step's draft logits of the token at each anchor.
        out: the round's proposal buffers, [B, N] wide.

    Returns:
        (parents [B, N] int64 with -1 beyond a request's nodes, num_nodes [B] int64), host.

    RNG: `sample_draft` with tree keys per drawn node (none for a greedy drafter).
    """
    size, width = batch.batch_size, out.draft_token_ids.shape[1]
    budgets = batch.num_draft.tolist()
    live = [b for b in range(size) if budgets[b] > 0]
    trees = start_trees(batch, tree, live)
    parents_rows = [(b, -1) for b in live]
    level_logits = logits[to_device(live, torch.int64, logits.device)] if live else logits[:0]
    for depth in range(tree.depth):
        if not parents_rows:
            break
        draw_level(drafter, batch, trees, parents_rows, level_logits, None, depth, tree, out)
        if depth + 1 == tree.depth:
            break
        parents_rows = expand_frontier(trees, depth, tree.topk)
        if parents_rows:
            level_logits = _tree_level(drafter, trees, parents_rows, states)
    return tree_layout(trees, size, width)


def _tree_level(drafter, trees, parents_rows, states) -> torch.Tensor:
    """The draft logits after each node to expand ([len(parents_rows), V], in that order): one
    tree step per request over [its last committed token, its nodes so far]."""
    requests = list(dict.fromkeys(b for b, _ in parents_rows))
    inputs = []
    for b in requests:
        grown, state = trees[b], states[b]
        start = len(state.token_ids) - 1  # the last committed token (its K/V rewritten)
        tokens = [state.token_ids[-1], *grown.tokens]
        inputs.append(StepInput(tokens, start, state.block_ids, len(tokens), list(grown.parents)))
    per_request = dict(zip(requests, drafter.runner.run(inputs), strict=True))
    # Row 1 + m of a request's logits follows its node m.
    return torch.stack([per_request[b][1 + node] for b, node in parents_rows])
