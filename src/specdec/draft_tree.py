"""The shape of a draft tree and what follows from it: depths, children in order, ancestor masks.

A round's tree over N draft nodes is given by `parents` [B, N] int64: parents[b, n] = ROOT (-1)
for a child of the round's input token, else the index of its parent, always < n (nodes come in
topological order). Node n's token sits at position anchor + depth[n]. A chain of K drafts is
the tree with parents [-1, 0, 1, ..., K-2]. Pure index arithmetic: never draws noise, never reads
logits, never imports anything above `torch`.
"""

from __future__ import annotations

import torch

ROOT = -1


def chain_parents(batch: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, K] int64 parents of a chain of K drafts: [-1, 0, 1, ..., K-2] per row."""
    return (torch.arange(k, device=device) - 1).expand(batch, k).contiguous()


def live_nodes(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> torch.Tensor:
    """[B, N] bool: node n of row b is part of the tree (n < num_nodes[b]; all when None)."""
    batch, n = parents.shape
    if num_nodes is None:
        return torch.ones(batch, n, dtype=torch.bool, device=parents.device)
    return torch.arange(n, device=parents.device)[None, :] < num_nodes[:, None]


def check_parents(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> None:
    """Raises ValueError unless every live node's parent is ROOT or an earlier node.

    Args:
        parents: [B, N] int64.
        num_nodes: [B] int64 in [0, N] live nodes per row, or None (all N).
    """
    if parents.dtype != torch.int64 or parents.dim() != 2:
        raise ValueError(f"parents must be int64 [B, N], got {parents.dtype} {list(parents.shape)}")
    n = parents.shape[1]
    if num_nodes is not None:
        if num_nodes.dtype != torch.int64 or num_nodes.shape != (parents.shape[0],):
            raise ValueError(f"num_nodes must be int64 [B={parents.shape[0]}]")
        if bool(((num_nodes < 0) | (num_nodes > n)).any()):
            raise ValueError(f"num_nodes must lie in [0, N={n}]")
    index = torch.arange(n, device=parents.device)[None, :]
    bad = live_nodes(parents, num_nodes) & ((parents < ROOT) | (parents >= index))
    if bool(bad.any()):
        raise ValueError(
            "parents[b, n] must be -1 (a child of the round's input token) or an earlier node "
            "index < n (nodes in topological order)"
        )


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 depth of each node (0 for a child of the root): its token is at
    anchor + depth. Entries of dead nodes are meaningless."""
    batch, n = parents.shape
    depths = torch.zeros(batch, n, dtype=torch.int64, device=parents.device)
    for node in range(n):
        parent = parents[:, node]
        above = depths.gather(1, parent.clamp_min(0)[:, None]).squeeze(1) + 1
        depths[:, node] = torch.where(parent < 0, 0, above)
    return depths


def ancestor_mask(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N, N] bool: mask[b, i, j] iff node j is node i or one of its ancestors (the draft
    tokens node i may attend to besides the cached prefix). Dead nodes see only themselves."""
    batch, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    mask = eye.expand(batch, n, n).clone()
    live = live_nodes(parents, num_nodes)
    for node in range(n):
        parent = parents[:, node]
        has_parent = (parent >= 0) & live[:, node]
        above = mask[torch.arange(batch, device=parents.device), parent.clamp_min(0)]  # [B, N]
        mask[:, node] |= above & has_parent[:, None]
    return mask


def children_table(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N+1, C] int64: row 0 lists the root's children, row n+1 node n's, each in node order
    (their sibling rank), padded with -1; C = the most children of any node (at least 1)."""
    batch, n = parents.shape
    device = parents.device
    table_rows = n + 1
    live = live_nodes(parents, num_nodes)
    slot = torch.where(live, parents + 1, 0)  # [B, N] row of each node's parent
    rank = sibling_ranks(parents, num_nodes).masked_fill(~live, -1)  # [B, N]
    width = max(1, int(rank.max()) + 1) if rank.numel() else 1
    table = torch.full((batch, table_rows * width), -1, dtype=torch.int64, device=device)
    flat = slot * width + rank.clamp_min(0)
    nodes = torch.arange(n, device=device).expand(batch, n)
    flat = torch.where(live, flat, table_rows * width)  # dead nodes write past the end
    table = torch.cat([table, table.new_full((batch, 1), -1)], dim=1)
    table.scatter_(1, flat, torch.where(live, nodes, -1))
    return table[:, :-1].view(batch, table_rows, width)


def sibling_ranks(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N] int64 rank of each node among its parent's children (0 = first child)."""
    n = parents.shape[1]
    live = live_nodes(parents, num_nodes)
    slot = torch.where(live, parents + 1, 0)
    one_hot = torch.nn.functional.one_hot(slot, n + 1) & live[..., None]
    return (one_hot.cumsum(dim=1) - 1).gather(2, slot[..., None]).squeeze(2).clamp_min(0)


def verify_step_mask(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N+1, N+1] bool tree mask of a verify step over [input token, node 0, ..., node N-1]:
    the input token sees itself; node n sees the input token, its ancestors and itself (the
    `tree_mask` of `AttentionMetadata` / `DecodeMetadata`)."""
    batch, n = parents.shape
    mask = torch.zeros(batch, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    mask[:, :, 0] = True
    mask[:, 1:, 1:] = ancestor_mask(parents, num_nodes)
    return mask


def verify_step_positions(parents: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[B, N+1] int64 positions of a verify step's tokens: the input token at anchor - 1, node
    n at anchor + depth[n] (the positions RoPE rotates them by; their cache slots stay in node
    order until the accepted path is compacted)."""
    depths = node_depths(parents)
    return torch.cat([anchors[:, None] - 1, anchors[:, None] + depths], dim=1)


def path_slots_to_compact(
    accepted_nodes: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the accepted path of each row, which verify-step token holds the K/V of the i-th
    accepted node and which it belongs at: ([B, N] source index 1 + node, [B, N] target index
    1 + i), both -1 beyond num_accepted (index 0 is the input token, which stays)."""
    n = accepted_nodes.shape[1]
    columns = torch.arange(n, device=accepted_nodes.device)[None, :]
    live = columns < num_accepted[:, None]
    source = torch.where(live, accepted_nodes + 1, -1)
    target = torch.where(live, columns + 1, -1)
    return source, target


def region_rows(step_mask: torch.Tensor | None, num_queries: int, width: int) -> torch.Tensor:
    """[Q, W] rows of one sequence in a step's tree region of width W (the last W keys): a
    tree's [Q, Q] verify-step mask left-padded with visible prefix keys (Q <= W), or (None) the
    causal rule of Q new tokens at the end of the context (any Q: rows whose position is before
    a region key do not see it)."""
    if step_mask is None:
        query = torch.arange(num_queries)[:, None] + (width - num_queries)
        return torch.arange(width)[None, :] <= query
    pad = torch.ones(num_queries, width - num_queries, dtype=torch.bool)
    return torch.cat([pad, step_mask.to("cpu")], dim=1)
