"""Growing a draft tree, the steps every tree drafter shares: drawing a level's children, and
choosing the frontier nodes to expand next (EAGLE-2's cumulative draft log-probability).

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

from specdec.transfer import to_device

NEG_INF = float("-inf")

if TYPE_CHECKING:
    from specdec.drafters.base import DraftBatch, Drafter
    from specdec.drafters.config import TreeConfig


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
    prefix: torch.Tensor | None = None,
) -> Children:
    """Draws the children of M parents from the draft logits after each parent, processed by
    the requests' logits rules (`batch.context`) with each parent's path as the drafts before.

    Args:
        drafter: the drafter (its `sample_draft` owns the noise; `greedy` takes the top tokens).
        logits: [M, V_draft] raw draft logits of the token after each parent.
        rows: [M] int64 request index (into `batch`) of each parent, on the host.
        positions: [M] int64 position Q of the children's tokens.
        batch: the round's batch.
        nodes: [M, C] int64 tree node index of each parent's i-th child (-1: no such child; a
            parent's children come first, then nothing), on the host.
        prefix: [M, J] int64 each parent's path (`path_prefix`), on the host; None: no context.

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
        full = with_context(drafter, drafter.to_target_vocab(logits), rows, prefix, batch)
        top = full.topk(min(width, vocab), dim=-1)  # [M, min(C, V)]
        # a token the rules or the grammar exclude is no child
        tokens[:, : top.indices.shape[1]] = top.indices.masked_fill(top.values == NEG_INF, -1)
        tokens = torch.where(nodes.to(device) >= 0, tokens, -1)
        return Children(tokens, None)
    processed = torch.full((num_parents, width, vocab), float("-inf"), device=device)
    positions = positions.to(torch.int64)
    nodes = nodes.clone()
    for rank in range(width):
        picked = (nodes[:, rank] >= 0).nonzero().squeeze(1)  # host
        if rank and batch.context is not None:
            picked = _drawable(drafter, logits, rows, prefix, batch, picked, tokens[:, :rank])
            nodes[:, rank:] = torch.where(
                torch.isin(torch.arange(num_parents), picked)[:, None], nodes[:, rank:], -1
            )
        if picked.numel() == 0:
            break
        on = picked.to(device)
        out = drafter.sample_draft(
            logits[on],
            rows[picked],
            positions[picked.to(positions.device)],
            batch,
            prefix=None if prefix is None else prefix[picked],
            tree_nodes=nodes[picked, rank],
            tree_ranks=torch.full((picked.numel(),), rank, dtype=torch.int64),
            exclude=tokens[on, :rank],
        )
        tokens[on, rank] = out.token_ids
        processed[on, rank] = out.processed_logits
    return Children(tokens, processed)


def _drawable(drafter, logits, rows, prefix, batch, picked, earlier) -> torch.Tensor:
    """Those of the parents `picked` (host indices) whose draft distribution, processed by the
    requests' rules after the parent's path, still allows a token their `earlier` children did
    not take: the rules or a grammar may allow fewer tokens than the tree has siblings, and a
    sibling drawn without replacement from nothing is no child."""
    if picked.numel() == 0:
        return picked
    on = picked.to(logits.device)
    full = drafter.to_target_vocab(logits[on])
    full = with_context(
        drafter, full, rows[picked], None if prefix is None else prefix[picked], batch
    )
    taken = earlier[on]
    full = torch.cat([full, full.new_zeros(full.shape[0], 1)], dim=1)
    full = full.scatter(1, torch.where(taken >= 0, taken, full.shape[1] - 1), NEG_INF)[:, :-1]
    left = torch.isfinite(full).any(dim=1).to("cpu")
    return picked[left]


def with_context(
    drafter: Drafter,
    full: torch.Tensor,
    rows: torch.Tensor,
    prefix: torch.Tensor | None,
    batch: DraftBatch,
) -> torch.Tensor:
    """[M, V_target] draft logits processed by the requests' logits rules after each row's
    `prefix` (`full` itself without a `batch.context`)."""
    if batch.context is None:
        return full
    index = to_device(rows.to("cpu", torch.int64), torch.int64, full.device)
    return batch.context.apply(full, index, None if prefix is None else prefix.to(full.device))


def path_prefix(
    trees: dict[int, GrowingTree], pairs: list[tuple[int, int]], batch: DraftBatch
) -> torch.Tensor | None:
    """[M, J] int64 the tokens of each (request, node) pair's path — the node's ancestors, root
    side first, then the node; nothing for the root (-1) — padded with -1, on the host: the
    drafts before its children, as the requests' logits rules see them. None without a
    `batch.context` (nothing reads it)."""
    if batch.context is None:
        return None
    paths = []
    for b, node in pairs:
        grown = trees[b]
        paths.append([grown.tokens[n] for n in reversed(grown.ancestors_and_self(node))])
    width = max(1, max((len(path) for path in paths), default=0))
    return torch.tensor([path + [-1] * (width - len(path)) for path in paths], dtype=torch.int64)


class GrowingTree:
    """One request's tree being grown (host lists), node n in drafting order.

    A greedy request (temperature 0) grows best-first (`wave` > 0): each step offers the top
    `offer` children of every node added by the step before as candidates, and the `wave`
    candidates of highest cumulative draft log-probability over the whole tree become nodes
    (the last step: as many as the budget has left).
    Any tree is exact for it (greedy verification compares tokens with the target's argmax
    alone), so the tree may depend on the drafts' own probabilities, as EAGLE-2's re-ranking
    does. Sampled requests grow level by level (`draw_level`, `expand_frontier`).
    """

    __slots__ = (
        "budget",
        "coupled",
        "cum_logp",
        "depths",
        "hidden",
        "last_wave",
        "offer",
        "on_first_path",
        "parents",
        "pool",
        "tokens",
        "wave",
    )

    def __init__(self, budget: int, coupled: bool, wave: int = 0, offer: int = 0) -> None:
        self.budget = budget
        self.coupled = coupled
        self.wave = wave  # > 0: best-first, nodes added a step
        self.offer = max(offer, wave)  # best-first: candidates each new node offers
        # Best-first candidates: (cum_logp, order, parent, token, draft logits row, hidden).
        self.pool: list[tuple] = []
        self.last_wave: list[int] = []  # the nodes the last best-first step added
        self.on_first_path: list[bool] = []  # first child of a first child ... of the root
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.tokens: list[int] = []
        self.cum_logp: list[float] = []
        # The head output each node's entry is fed with (EAGLE; empty for a draft model).
        self.hidden: list[torch.Tensor] = []

    def ancestors_and_self(self, node: int) -> list[int]:
        chain = []
        while node >= 0:
            chain.append(node)
            node = self.parents[node]
        return chain


def draw_level(drafter, batch, trees, parents_rows, logits, hidden, depth, tree, out) -> None:
    """Draws the children of `parents_rows` ((request, parent node) pairs, one logits row and,
    for EAGLE, one head output each; `hidden` None for a draft model), as many as each
    request's budget allows, and records them (best-first trees: `grow_best_first`)."""
    last = depth + 1 == tree.depth
    grow_best_first(drafter, batch, trees, parents_rows, logits, hidden, out, last)
    node_table, kept = [], []
    next_node = {b: len(grown.parents) for b, grown in trees.items()}
    for i, (b, _parent) in enumerate(parents_rows):
        first = next_node[b]
        count = 0 if trees[b].wave else max(0, min(tree.topk, trees[b].budget - first))
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
    prefix = path_prefix(trees, [parents_rows[i] for i in kept], batch)
    children = draw_children(
        drafter,
        logits[index],
        torch.tensor(rows, dtype=torch.int64),
        positions,
        batch,
        nodes,
        prefix,
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
        for rank in range(len(node_table[i])):
            if int(tokens[j, rank]) < 0:  # no sibling left to draw (`_drawable`): the budget
                break  # of the nodes not drawn stays for the next level
            node = len(grown.parents)  # = node_table[i][rank] unless a sibling before was none
            grown.parents.append(parent)
            grown.depths.append(depth)
            grown.tokens.append(int(tokens[j, rank]))
            grown.cum_logp.append(base + float(picked[j, rank]))
            grown.on_first_path.append(rank == 0 and (parent < 0 or grown.on_first_path[parent]))
            if hidden is not None:
                grown.hidden.append(hidden[i])
            out.draft_token_ids[b, node] = children.token_ids[j, rank]
            if children.draft_logits is not None:
                row = children.draft_logits[j, rank]
                out.draft_logits[b, node] = row
                out.draft_logsumexp[b, node] = row.logsumexp(dim=-1)


def grow_best_first(drafter, batch, trees, parents_rows, logits, hidden, out, last) -> None:
    """One best-first step of the greedy trees among `parents_rows`: the top `offer` children
    of each of their parents join the tree's candidates (with the parent's draft logits, and
    for EAGLE its head output), then the `wave` best candidates by cumulative draft
    log-probability (ties: the earlier offered; the `last` step: all the budget left) become
    nodes. A candidate's parent is always a node already, so node order stays topological. No
    noise: greedy rows draw nothing."""
    rows = [i for i, (b, _parent) in enumerate(parents_rows) if trees[b].wave]
    if not rows:
        return
    full = drafter.to_target_vocab(logits[to_device(rows, torch.int64, logits.device)]).float()
    pairs = [parents_rows[i] for i in rows]
    requests = torch.tensor([b for b, _ in pairs], dtype=torch.int64)
    full = with_context(drafter, full, requests, path_prefix(trees, pairs, batch), batch)
    log_probs = full.log_softmax(dim=-1)
    width = min(max(trees[parents_rows[i][0]].offer for i in rows), full.shape[-1])
    top = log_probs.topk(width, dim=-1)
    values, ids = top.values.to("cpu").tolist(), top.indices.to("cpu").tolist()
    touched = {}
    for j, i in enumerate(rows):
        b, parent = parents_rows[i]
        grown = trees[b]
        base = 0.0 if parent < 0 else grown.cum_logp[parent]
        for rank in range(min(grown.offer, width)):
            if values[j][rank] == float("-inf"):
                break
            entry = (base + values[j][rank], len(grown.pool), parent, ids[j][rank], full[j])
            grown.pool.append((*entry, None if hidden is None else hidden[i]))
        touched[b] = grown
    for b, grown in touched.items():
        grown.pool.sort(key=lambda c: (-c[0], c[1]))
        left = grown.budget - len(grown.parents)
        take = max(0, left if last else min(grown.wave, left))
        chosen, grown.pool = grown.pool[:take], grown.pool[take:]
        grown.last_wave = []
        for cum_logp, _order, parent, token, row, head_out in chosen:
            node = len(grown.parents)
            grown.parents.append(parent)
            grown.depths.append(0 if parent < 0 else grown.depths[parent] + 1)
            grown.tokens.append(token)
            grown.cum_logp.append(cum_logp)
            grown.on_first_path.append(False)
            if head_out is not None:
                grown.hidden.append(head_out)
            grown.last_wave.append(node)
            out.draft_token_ids[b, node] = token
            if not drafter.greedy:  # the row a temperature-0 draw reads (logits / 1)
                out.draft_logits[b, node] = row
                out.draft_logsumexp[b, node] = row.logsumexp(dim=-1)


def expand_frontier(trees: dict[int, GrowingTree], depth: int, topk: int) -> list[tuple[int, int]]:
    """The (request, node) pairs to expand next: per request with budget left, the `topk`
    nodes at `depth` of highest cumulative draft log-probability (ties: the earlier node). A
    coupled request expands its first path first: its first children carry the target's own
    noise, so they are the drafts most likely to equal the target's samples (the chain a coupled
    chain would draft), whatever their draft probability."""
    chosen = []
    for b, grown in trees.items():
        if len(grown.parents) >= grown.budget:
            continue
        if grown.wave:  # best-first: the nodes the last step added offer their children
            chosen += [(b, n) for n in grown.last_wave]
            continue
        frontier = [n for n, d in enumerate(grown.depths) if d == depth]
        frontier.sort(
            key=lambda n: (-(grown.coupled and grown.on_first_path[n]), -grown.cum_logp[n], n)
        )
        chosen += [(b, n) for n in frontier[:topk]]
    return chosen


def start_trees(batch: DraftBatch, tree: TreeConfig, live: list[int]) -> dict[int, GrowingTree]:
    """One empty tree per live request: its node budget min(num_draft[b], tree.nodes); a
    coupled request expands its first path first (`expand_frontier`); a greedy one grows
    best-first in `depth` steps of max(1, budget // depth) nodes, the last step taking what
    the budget has left, so a confident path can reach `depth` levels."""
    budgets = batch.num_draft.tolist()
    greedy = (batch.params.temperature == 0).tolist()
    trees = {}
    for b in live:
        budget = min(budgets[b], tree.nodes)
        coupled = batch.methods[b] == "coupled"
        if not greedy[b]:
            trees[b] = GrowingTree(budget, coupled)
            continue
        wave = max(1, budget // tree.depth)
        trees[b] = GrowingTree(budget, coupled, wave, budget - (tree.depth - 1) * wave)
    return trees


def tree_layout(
    trees: dict[int, GrowingTree], size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents [size, width] int64, -1 beyond a request's nodes; num_nodes [size] int64) of the
    grown trees, on the host."""
    parents = torch.full((size, width), -1, dtype=torch.int64)
    num_nodes = torch.zeros(size, dtype=torch.int64)
    for b, grown in trees.items():
        count = len(grown.parents)
        parents[b, :count] = torch.tensor(grown.parents, dtype=torch.int64)
        num_nodes[b] = count
    return parents, num_nodes
