"""Draft trees over the audit's toy Markov models (tests only): a drafter whose draws go through
the real `Drafter.sample_draft` / `draw_children`, and a driver that runs whole requests round by
round with `verify_tree`, so the tests can compare the emitted sequences with the exact law."""

from __future__ import annotations

import torch

from specdec.audit.laws import MarkovToy, Processing
from specdec.draft_tree import children_table, node_depths, sibling_ranks
from specdec.drafters.base import DraftBatch, Drafter, Proposal
from specdec.drafters.tree import draw_children
from specdec.sampling import SamplingTensors
from specdec.verify.tree import verify_tree

# Shapes used by the tests: parents per node (node order is topological).
WIDE_TREE = (-1, -1, -1, 0, 0, 1, 3)  # three first-level candidates, depth 3
DEEP_TREE = (-1, -1, 0, 0, 1, 2, 2, 5)  # two per level on the main branch, depth 4
CHAIN3 = (-1, 0, 1)


class ToyDrafter(Drafter):
    """A bigram draft model; its `propose` is unused (the driver draws trees level by level)."""

    def __init__(self, toy: MarkovToy, greedy: bool = False):
        super().__init__(toy.vocab_size, greedy=greedy)
        self.toy = toy

    def propose(self, batch: DraftBatch) -> Proposal:
        raise AssertionError("ToyDrafter drafts through draw_tree; nothing may call propose")


def draw_tree(
    drafter: ToyDrafter,
    parents: torch.Tensor,
    last_tokens: torch.Tensor,
    batch: DraftBatch,
    *,
    with_replacement: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts one tree per request, depth by depth.

    Args:
        parents: [N] int64 the tree shape (the same for every request).
        last_tokens: [B] int64 each request's input token.
        with_replacement: draw each child independently from its parent's distribution (its own
            key, no exclusion) instead of `draw_children`'s sampling without replacement.

    Returns:
        (token_ids [B, N], draft_logits [B, N, V] or None).
    """
    batch_size, n = last_tokens.shape[0], parents.shape[0]
    vocab = drafter.toy.vocab_size
    shape = parents[None, :]
    table = children_table(shape)[0]  # [N+1, C]
    depths = node_depths(shape)[0]
    tokens = torch.full((batch_size, n), -1, dtype=torch.int64)
    logits = None if drafter.greedy else torch.full((batch_size, n, vocab), float("-inf"))
    rows = torch.arange(batch_size)
    frontier = [0]  # table rows of the nodes whose children are drawn next (0 = root)
    depth = 0
    while frontier:
        for parent_row in frontier:
            kids = table[parent_row]
            kids = kids[kids >= 0]
            if kids.numel() == 0:
                continue
            before = last_tokens if parent_row == 0 else tokens[:, parent_row - 1]
            raw = drafter.toy.draft_logits[before]  # [B, V]
            positions = batch.anchors + depth
            if with_replacement:
                for rank, node in enumerate(kids.tolist()):
                    out = drafter.sample_draft(
                        raw,
                        rows,
                        positions,
                        batch,
                        tree_nodes=torch.full((batch_size,), node),
                        tree_ranks=torch.full((batch_size,), rank),
                    )
                    tokens[:, node] = out.token_ids
                    logits[:, node] = out.processed_logits
                continue
            nodes = kids[None, :].expand(batch_size, -1)
            children = draw_children(drafter, raw, rows, positions, batch, nodes)
            tokens[:, kids] = children.token_ids
            if logits is not None:
                logits[:, kids] = children.draft_logits
        depth += 1
        frontier = [int(k) + 1 for k in (depths == depth - 1).nonzero().squeeze(1)]
        frontier = [r for r in frontier if bool((table[r] >= 0).any())]
    return tokens, logits


def run_tree_requests(
    toy: MarkovToy,
    processing: Processing,
    parents: tuple[int, ...],
    method: str,
    num_requests: int,
    num_tokens: int,
    seed: int,
    *,
    with_replacement: bool = False,
    greedy_drafts: bool = False,
    prompt_length: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs `num_requests` requests (seeds seed*10**6 + i) round by round, one tree per round,
    until each has emitted `num_tokens` tokens.

    Returns:
        (tokens [R, num_tokens] int64, first-round accepted counts [R] int64, rounds [R] int64).
    """
    shape = torch.tensor(parents, dtype=torch.int64)
    drafter = ToyDrafter(toy, greedy=greedy_drafts)
    seeds = torch.arange(num_requests, dtype=torch.int64) + seed * 10**6
    emitted = torch.full((num_requests, num_tokens + shape.shape[0] + 1), -1, dtype=torch.int64)
    counts = torch.zeros(num_requests, dtype=torch.int64)
    rounds = torch.zeros(num_requests, dtype=torch.int64)
    first_accepted = None
    params = SamplingTensors.build(num_requests, torch.device("cpu"), **processing.kwargs())
    while bool((counts < num_tokens).any()):
        rows = (counts < num_tokens).nonzero().squeeze(1)
        size = rows.numel()
        previous = emitted[rows, (counts[rows] - 1).clamp_min(0)]
        last = torch.where(counts[rows] > 0, previous, toy.start_token)
        anchors = prompt_length + counts[rows]
        row_params = SamplingTensors(
            *(None if t is None else t[rows] for t in dataclass_fields(params))
        )
        batch = DraftBatch(
            token_ids=[[0]] * size,
            seeds=seeds[rows],
            anchors=anchors,
            num_draft=torch.full((size,), shape.shape[0]),
            methods=[method] * size,
            params=row_params,
        )
        tokens, draft_logits = draw_tree(
            drafter, shape, last, batch, with_replacement=with_replacement
        )
        before = torch.cat([last[:, None], tokens], dim=1)  # [R, N+1] token before each row
        target_logits = toy.target_logits[before]
        result = verify_tree(
            target_logits,
            shape.expand(size, -1),
            tokens,
            draft_logits,
            seeds[rows],
            anchors,
            method=method,
            **processing.kwargs(),
        )
        if first_accepted is None:
            first_accepted = result.num_accepted.clone()
        for width in range(1, result.token_ids.shape[1] + 1):
            take = (result.num_accepted + 1 == width).nonzero().squeeze(1)
            if take.numel() == 0:
                continue
            at = rows[take]
            columns = counts[at][:, None] + torch.arange(width)[None, :]
            emitted[at[:, None], columns] = result.token_ids[take, :width]
        counts[rows] += result.num_accepted + 1
        rounds[rows] += 1
    return emitted[:, :num_tokens], first_accepted, rounds


def dataclass_fields(params: SamplingTensors) -> tuple:
    return (params.temperature, params.top_k, params.top_p, params.min_p)


def tree_ranks(parents: torch.Tensor) -> torch.Tensor:
    """[N] sibling ranks of a single tree shape."""
    return sibling_ranks(parents[None, :])[0]


def run_plain_requests(
    toy: MarkovToy,
    processing: Processing,
    num_requests: int,
    num_tokens: int,
    seed: int,
    *,
    prompt_length: int = 3,
) -> torch.Tensor:
    """The same requests decoded plainly (one `sample` per token, Stream.TARGET at Q):
    [R, num_tokens] int64."""
    from specdec.sampling import sample

    seeds = torch.arange(num_requests, dtype=torch.int64) + seed * 10**6
    last = torch.full((num_requests,), toy.start_token, dtype=torch.int64)
    out = []
    for t in range(num_tokens):
        positions = torch.full((num_requests,), prompt_length + t, dtype=torch.int64)
        last = sample(toy.target_logits[last], seeds, positions, **processing.kwargs()).token_ids
        out.append(last)
    return torch.stack(out, dim=1)


# Shapes of the tree-walk parity checks (GPU, and the Triton interpreter on the CPU).
PARITY_SHAPES = {
    "wide": [-1, -1, -1, 0, 0, 1, 3, 3, 6],
    "deep": [-1, -1, 0, 0, 1, 2, 2, 5, 7, 8],
    "chain": [-1, 0, 1, 2],
}


def near_round(generator, shape, batch, vocab, temperature, sampled, top_k):
    """Random target rows, drafts near them, node tokens drawn from each node's draft row."""
    n = len(shape)
    target = torch.randn(batch, n + 1, vocab, generator=generator) * 2.0
    # Node n's draft row is meant for the token after its parent: reuse the parent's row.
    parent_rows = torch.tensor([p + 1 for p in shape])
    draft = target[:, parent_rows] + 0.7 * torch.randn(batch, n, vocab, generator=generator)
    if top_k:
        threshold = draft.topk(top_k, dim=-1).values[..., -1:]
        draft = torch.where(draft >= threshold, draft, float("-inf"))
    probs = torch.softmax(draft / max(temperature, 0.5), dim=-1)
    tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=generator).view(batch, n)
    draft_logits = (draft / max(temperature, 0.5)) if sampled else None
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator)
    positions = torch.randint(5, 2**20, (batch,), generator=generator)
    num_nodes = torch.randint(0, n + 1, (batch,), generator=generator)
    parents = torch.tensor(shape).expand(batch, n).contiguous()
    return target, tokens, draft_logits, seeds, positions, num_nodes, parents
