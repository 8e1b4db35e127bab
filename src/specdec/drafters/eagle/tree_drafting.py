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
from specdec.drafters.tree import draw_children
from specdec.models.attention import DecodeMetadata, cache_slots
from specdec.transfer import to_device


class _Tree:
    """One request's tree being grown (host lists), node n in drafting order."""

    __slots__ = (
        "budget",
        "coupled",
        "cum_logp",
        "depths",
        "hidden",
        "on_first_path",
        "parents",
        "tokens",
    )

    def __init__(self, budget: int, coupled: bool) -> None:
        self.budget = budget
        self.coupled = coupled
        self.on_first_path: list[bool] = []  # first child of a first child ... of the root
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.tokens: list[int] = []
        self.cum_logp: list[float] = []
        self.hidden: list[torch.Tensor] = []  # the head output each node's entry is fed with

    def ancestors_and_self(self, node: int) -> list[int]:
        chain = []
        while node >= 0:
            chain.append(node)
            node = self.parents[node]
        return chain


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
    budgets = batch.num_draft.tolist()
    trees = {b: _Tree(min(budgets[b], tree.nodes), batch.methods[b] == "coupled") for b in live}
    # Level 0: the root's children, from the catch-up logits.
    parents_rows = [(b, -1) for b in live]
    level_logits, level_hidden = logits, last
    for depth in range(tree.depth):
        _draw_level(
            drafter, batch, trees, parents_rows, level_logits, level_hidden, depth, tree, out
        )
        if depth + 1 == tree.depth:
            break
        parents_rows = _expand(trees, depth, tree.topk)
        if not parents_rows:
            break
        level_hidden = _head_level(drafter, trees, parents_rows, states, anchors)
        level_logits = head_logits(drafter.head, level_hidden, drafter.lm_weight)
    parents = torch.full((size, width), -1, dtype=torch.int64)
    num_nodes = torch.zeros(size, dtype=torch.int64)
    for b, grown in trees.items():
        count = len(grown.parents)
        parents[b, :count] = torch.tensor(grown.parents, dtype=torch.int64)
        num_nodes[b] = count
    return parents, num_nodes


def _draw_level(drafter, batch, trees, parents_rows, logits, hidden, depth, tree, out) -> None:
    """Draws the children of `parents_rows` ((request, parent node) pairs, one logits row and
    one head output each), as many as each request's budget allows, and records them."""
    node_table, kept = [], []
    next_node = {b: len(grown.parents) for b, grown in trees.items()}
    for i, (b, _parent) in enumerate(parents_rows):
        first = next_node[b]
        count = max(0, min(tree.topk, trees[b].budget - first))
        node_table.append(list(range(first, first + count)))
        next_node[b] += count
        if count:
            kept.append(i)
    if not kept:
        return
    rows = [parents_rows[i][0] for i in kept]
    nodes = torch.full((len(kept), tree.topk), -1, dtype=torch.int64)
    for j, i in enumerate(kept):
        nodes[j, : len(node_table[i])] = torch.tensor(node_table[i])
    index = to_device(kept, torch.int64, logits.device)
    positions = torch.tensor([batch.anchors[r] + depth for r in rows], dtype=torch.int64)
    children = draw_children(
        drafter, logits[index], torch.tensor(rows, dtype=torch.int64), positions, batch, nodes
    )
    tokens = children.token_ids.to("cpu")
    if children.draft_logits is None:
        log_probs = drafter.to_target_vocab(logits[index]).log_softmax(dim=-1)  # [M, V]
        picked = log_probs.gather(1, children.token_ids.clamp_min(0)).to("cpu")
    else:
        log_probs = children.draft_logits.log_softmax(dim=-1)  # [M, C, V]
        picked = log_probs.gather(2, children.token_ids.clamp_min(0)[..., None])[..., 0]
        picked = picked.to("cpu")
    for j, i in enumerate(kept):
        b, parent = parents_rows[i]
        grown = trees[b]
        base = 0.0 if parent < 0 else grown.cum_logp[parent]
        for rank, node in enumerate(node_table[i]):
            grown.parents.append(parent)
            grown.depths.append(depth)
            grown.tokens.append(int(tokens[j, rank]))
            grown.cum_logp.append(base + float(picked[j, rank]))
            grown.on_first_path.append(rank == 0 and (parent < 0 or grown.on_first_path[parent]))
            grown.hidden.append(hidden[i])
            out.draft_token_ids[b, node] = children.token_ids[j, rank]
            if children.draft_logits is not None:
                row = children.draft_logits[j, rank]
                out.draft_logits[b, node] = row
                out.draft_logsumexp[b, node] = row.logsumexp(dim=-1)


def _expand(trees: dict[int, _Tree], depth: int, topk: int) -> list[tuple[int, int]]:
    """The (request, node) pairs to expand next: per request with budget left, the `topk`
    nodes at `depth` of highest cumulative draft log-probability (ties: the earlier node). A
    coupled request expands its first path first: its first children carry the target's own
    noise, so they are the drafts most likely to equal the target's samples (the chain a coupled
    chain would draft), whatever their draft probability."""
    chosen = []
    for b, grown in trees.items():
        if len(grown.parents) >= grown.budget:
            continue
        frontier = [n for n, d in enumerate(grown.depths) if d == depth]
        frontier.sort(
            key=lambda n: (-(grown.coupled and grown.on_first_path[n]), -grown.cum_logp[n], n)
        )
        chosen += [(b, n) for n in frontier[:topk]]
    return chosen


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
    hidden = torch.zeros(rows, drafter.head.config.hidden_size, dtype=drafter.head.fc.weight.dtype)
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
