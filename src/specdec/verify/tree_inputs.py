"""What both twins of the tree walk share: the result type, and the processed inputs
(`prepare_tree`, in PyTorch on any device, so that the twins start from the same bits); which
target rows a walk read (`first_unusable_read_depth`); the target rows processed by the
requests' logits rules along each node's path (`tree_context_target_logits`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.draft_tree import children_table, node_depths
from specdec.sampling.context import LogitsContext
from specdec.sampling.processing import process_logits, unusable_rows
from specdec.transfer import to_device


@dataclass(frozen=True, slots=True)
class TreeVerifyResult:
    """Attributes:
    token_ids: [B, N+1] int64 emitted tokens (the accepted path's tokens, then the recovered or
        bonus token), padded with -1.
    num_accepted: [B] int64 accepted nodes per row; the row emits num_accepted + 1 tokens.
    accepted_nodes: [B, N] int64 the accepted path's node indices, root side first, padded
        with -1 (what the KV compaction keeps).
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor


def tree_context_target_logits(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    parents: list[list[int]],
    context: LogitsContext,
) -> torch.Tensor:
    """Target logits processed by each request's context along each node's path: row 0 (the
    root's) with the request's output alone, row 1 + n with the tokens of node n's path (its
    ancestors, root side first, then n) appended to it, which is how plain decoding processes
    the position after node n once that path is accepted (so the walk stays exact for
    penalties, bans that depend on the output, and grammars). The tree analogue of
    `specdec.verify.inputs.context_target_logits`.

    Args:
        target_logits: [B, N+1, V] raw target logits.
        draft_token_ids: per request, its node tokens (node n at n; as many as it has nodes).
        parents: per request, each node's parent (-1: the root), as many as its tokens.
        context: the B requests' `LogitsContext`.

    Returns:
        [B, N+1, V] float32.
    """
    batch, num_rows, vocab = target_logits.shape
    depth = 1
    paths: list[list[int]] = []  # per row of the flattened [B * (N+1)], its prefix tokens
    for tokens, links in zip(draft_token_ids, parents, strict=True):
        paths.append([])  # the root's row
        node_paths: list[list[int]] = []
        for node, parent in enumerate(links):
            path = (node_paths[parent] if parent >= 0 else []) + [tokens[node]]
            node_paths.append(path)
            depth = max(depth, len(path))
        paths += node_paths + [[]] * (num_rows - 1 - len(links))  # padding rows: read by none
    device = target_logits.device
    flat_prefix = [t for path in paths for t in path + [-1] * (depth - len(path))]
    prefix = to_device(flat_prefix, torch.int64, device).view(batch * num_rows, depth)
    rows = torch.arange(batch, device=device).repeat_interleave(num_rows)
    flat = target_logits.reshape(batch * num_rows, vocab)
    return context.apply(flat, rows, prefix).view(batch, num_rows, vocab)


def first_unusable_read_depth(
    target_logits: torch.Tensor, result: TreeVerifyResult
) -> torch.Tensor:
    """Per request, the first depth of its walk whose row has no distribution (`unusable_rows`),
    or -1. The walk reads the rows of the nodes it visits: the root's (row 0), then row 1 + n of
    each accepted node n; the last one visited gives the recovered or bonus token. Device ops
    only, no host sync.

    Args:
        target_logits: [B, N+1, V] the target logits the walk read.
        result: its `TreeVerifyResult`.

    Returns:
        [B] int64 depth d in [0, N] (the row of the token at positions[b] + d), or -1.
    """
    batch, num_rows, _ = target_logits.shape
    bad = unusable_rows(target_logits)  # [B, N+1]
    root = torch.zeros(batch, 1, dtype=torch.int64, device=bad.device)
    visited = torch.cat([root, 1 + result.accepted_nodes[:, : num_rows - 1]], dim=1)  # pad: 0
    depths = torch.arange(num_rows, device=bad.device)[None, :]
    hit = bad.gather(1, visited.clamp_min(0)) & (depths <= result.num_accepted[:, None])
    first = torch.where(hit, depths, num_rows).amin(dim=-1)
    return torch.where(first < num_rows, first, -1)


@dataclass(frozen=True, slots=True)
class PreparedTree:
    """What both twins of the tree walk read (built by `prepare_tree`, in PyTorch on any
    device, so that the twins start from the same bits).

    Attributes:
        target: [B, N+1, V] float32 processed target logits (what `sample` draws from).
        target_logp: [B, N+1, V] float32 their log-softmax.
        draft_logits: [B, N, V] float32 processed draft logits, or None (one-hot drafts).
        draft_lse: [B, N] float32 their log-normalisers, or None.
        tokens: [B, N] int64 node tokens (0 for dead nodes).
        children: [B, N+1, C] int64 children table (`draft_tree.children_table`).
        greedy: [B] bool rows at temperature 0.
        seeds, anchors: [B] int64.
        max_depth: the deepest live node's depth + 1 (0 without nodes), host int.
        method: "standard" or "coupled".
    """

    target: torch.Tensor
    target_logp: torch.Tensor
    draft_logits: torch.Tensor | None
    draft_lse: torch.Tensor | None
    tokens: torch.Tensor
    children: torch.Tensor
    greedy: torch.Tensor
    seeds: torch.Tensor
    anchors: torch.Tensor
    max_depth: int
    method: str


def prepare_tree(inputs, parents: torch.Tensor) -> PreparedTree:
    """Processes the target rows, normalises the draft rows and lays out the tree (validated
    `check_verify_inputs` output plus [B, N] parents)."""
    target_logits = inputs.target_logits
    batch, num_rows, vocab = target_logits.shape
    n = num_rows - 1
    device = target_logits.device
    num_nodes = inputs.num_draft
    params = inputs.params
    row_params = params.repeat_interleave(num_rows)
    target = process_logits(
        target_logits.reshape(batch * num_rows, vocab),
        row_params.temperature,
        row_params.top_k,
        row_params.top_p,
        row_params.min_p,
    ).view(batch, num_rows, vocab)
    live = torch.arange(n, device=device)[None, :] < num_nodes[:, None]
    draft_logits = draft_lse = None
    if inputs.draft_logits is not None:
        draft_logits = inputs.draft_logits.to(torch.float32)
        draft_lse = draft_logits.logsumexp(dim=-1)  # [B, N]
    depths = node_depths(parents)
    max_depth = int(torch.where(live, depths + 1, 0).max()) if batch and n else 0
    return PreparedTree(
        target=target,
        target_logp=target.log_softmax(dim=-1),
        draft_logits=draft_logits,
        draft_lse=draft_lse,
        tokens=torch.where(live, inputs.draft_token_ids, 0),
        children=children_table(parents, num_nodes),
        greedy=params.temperature == 0,
        seeds=inputs.seeds,
        anchors=inputs.positions,
        max_depth=max_depth,
        method=inputs.method,
    )
