"""EAGLE tree drafting (EAGLE-2 style dynamic trees, Li et al. 2024) on the head's own cache.

After the round's catch-up step (the head output at entry A-2 and the draft logits of the token at
A), the root gets the `topk` best children; then, level by level, the `topk` frontier nodes of
highest cumulative draft log-probability each get `topk` children, within the round's node
budget. Expanding node m runs one head entry over (its parent's head output, m's token) at entry
A-1+depth[m] (RoPE position A+depth[m]) stored in the head-cache slot of entry A-1+m, attending
to the prefix entries and to m's ancestors only (a tree region of the last W entries). Children
are drawn through `draw_children` (`Drafter.sample_draft`): the tree's shape depends only on nodes
already drawn, never on a node's own draw after it, which keeps multi-draft verification exact.
Nodes are never pruned after they are drawn.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftBatch, Drafter, ProposalBuffer
from specdec.drafters.config import TreeConfig
from specdec.drafters.eagle.head import head_logits
from specdec.drafters.eagle.state import EagleState
from specdec.drafters.tree import draw_level, expand_frontier, start_trees, tree_layout
from specdec.models.attention import DecodeMetadata, cache_slots
from specdec.transfer import to_device


def propose_tree(
    drafter: Drafter,
    batch: DraftBatch,
    tree: TreeConfig,
    live: list[int],
    states: list[EagleState | None],
    last: torch.Tensor,
    logits: torch.Tensor,
    out: ProposalBuffer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grows one tree per live request into `out` ([B, N] columns in node order).

    Args:
        drafter: the EAGLE drafter (its head, cache, and `sample_draft`).
        batch: the round's batch; num_draft[b] is request b's node budget (<= tree.nodes).
        tree: the tree settings.
        live: requests with a catch-up output (anchors >= 2).
        states: per request, its head state (None for requests not in `live`).
        last: [len(live), D] the catch-up step's head output of each live request.
        logits: [len(live), V_draft] the draft logits of the token at each anchor.
        out: the round's proposal buffers, [B, N] wide.

    Returns:
        (parents [B, N] int64 with -1 beyond a request's nodes, num_nodes [B] int64), host.

    RNG: `sample_draft` with tree keys per drawn node (none for a greedy drafter).
    """
    size, width = batch.batch_size, out.draft_token_ids.shape[1]
    anchors = batch.anchors.tolist()
    trees = start_trees(batch, tree, live)
    # Level 0: the root's children, from the catch-up logits.
    parents_rows = [(b, -1) for b in live]
    level_logits, level_hidden = logits, last
    for depth in range(tree.depth):
        draw_level(
            drafter, batch, trees, parents_rows, level_logits, level_hidden, depth, tree, out
        )
        if depth + 1 == tree.depth:
            break
        parents_rows = expand_frontier(trees, depth, tree.topk)
        if not parents_rows:
            break
        level_hidden = _head_level(drafter, trees, parents_rows, states, anchors)
        level_logits = head_logits(drafter.head, level_hidden, drafter.lm_weight)
    return tree_layout(trees, size, width)


def _head_level(drafter, trees, parents_rows, states, anchors) -> torch.Tensor:
    """Runs the head entries of the nodes to expand, one tree-masked decode step for all of
    them. Returns their head outputs [len(parents_rows), D] in that order."""
    device = drafter.device
    requests = list(dict.fromkeys(b for b, _ in parents_rows))
    per_request = {b: [n for c, n in parents_rows if c == b] for b in requests}
    query_per_seq = max(len(nodes) for nodes in per_request.values())
    region = max(trees[b].budget for b in requests)  # entries A-1 .. A-2+region
    max_blocks = max(len(states[b].block_ids) for b in requests)
    num_seqs = len(requests)
    rows = num_seqs * query_per_seq
    slots = [-1] * rows
    positions = [0] * rows
    tokens = [0] * rows
    tables, context_lens, query_lens = [], [], []
    mask = torch.zeros(num_seqs, query_per_seq, region, dtype=torch.bool)
    hidden = torch.zeros(rows, drafter.head.config.hidden_size, dtype=drafter.head.dtype)
    hidden = hidden.to(device)
    row_of = {}
    for j, b in enumerate(requests):
        grown, anchor = trees[b], anchors[b]
        blocks = states[b].block_ids
        for i, node in enumerate(per_request[b]):
            row = j * query_per_seq + i
            row_of[(b, node)] = row
            slots[row] = int(cache_slots(blocks, [anchor - 1 + node], drafter.block_size)[0])
            positions[row] = anchor + grown.depths[node]
            tokens[row] = grown.tokens[node]
            hidden[row] = grown.hidden[node]
            mask[j, i, grown.ancestors_and_self(node)] = True
        tables += blocks + [0] * (max_blocks - len(blocks))
        context_lens.append(anchor - 1 + region)
        query_lens.append(len(per_request[b]))
    order = [row_of[pair] for pair in parents_rows]
    packed = to_device(
        slots + positions + tokens + context_lens + query_lens + tables, torch.int64, device
    )
    sizes = [rows, rows, rows, num_seqs, num_seqs, num_seqs * max_blocks]
    slots_t, positions_t, tokens_t, context_t, query_t, tables_t = packed.split(sizes)
    meta = DecodeMetadata(
        block_tables=tables_t.view(num_seqs, max_blocks),
        context_lens=context_t,
        query_lens=query_t,
        slot_mapping=slots_t,
        query_per_seq=query_per_seq,
        tree_mask=mask.to(device),
    )
    out = drafter.head.forward_decode(
        hidden, drafter.embed(tokens_t), positions_t, meta, drafter.kv_cache
    )
    return out[to_device(order, torch.int64, device)]
