"""The EAGLE head's inputs for a whole device round, computed at its start: the catch-up step's
(the entries the last round committed: their cache slots, positions, tokens, lengths and last
rows), every chained step's (one entry a slot at anchor - 1 + i) and the drafts' positions.

One Triton kernel on CUDA (one program per slot) where the same work in PyTorch is some fifty
small kernels, each a launch in the round's CUDA graph; the PyTorch twin runs elsewhere and
defines the values (integers: the kernel matches it bit for bit,
`tests/parity/test_round_bookkeeping_gpu.py`). Nothing here draws randomness or allocates.
"""

from __future__ import annotations

import torch

from specdec.drafters.eagle.step_inputs import HeadRoundInputs


def head_round_inputs(
    anchors: torch.Tensor,
    live: torch.Tensor,
    counts: torch.Tensor,
    entry_tokens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    out: HeadRoundInputs,
) -> None:
    """Writes `out` for slots with round anchors [S], live [S] bool, counts [S] (the entries the
    last round committed, <= W), entry_tokens [S, W] (the token after each of them) and the
    head's block tables [S, max_blocks]. Mutates: `out`'s tensors."""
    if anchors.is_cuda:
        from specdec.drafters.eagle.round_inputs_triton import head_round_inputs_triton

        head_round_inputs_triton(anchors, live, counts, entry_tokens, tables, block_size, out)
        return
    head_round_inputs_ref(anchors, live, counts, entry_tokens, tables, block_size, out)


def _cache_slots(tables: torch.Tensor, entries: torch.Tensor, block_size: int) -> torch.Tensor:
    """[S, N] cache slots of entries [S, N] >= 0 under tables [S, max_blocks]."""
    block = torch.div(entries, block_size, rounding_mode="floor").clamp_max(tables.shape[1] - 1)
    return tables.gather(1, block) * block_size + entries % block_size


def head_round_inputs_ref(
    anchors: torch.Tensor,
    live: torch.Tensor,
    counts: torch.Tensor,
    entry_tokens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    out: HeadRoundInputs,
) -> None:
    """The PyTorch twin of `head_round_inputs`."""
    rows, width = entry_tokens.shape
    device = anchors.device
    column = torch.arange(width, device=device)
    entries = anchors[:, None] - 1 - counts[:, None] + column  # [S, W]
    fed = live[:, None] & (column < counts[:, None])
    slots = _cache_slots(tables, entries.clamp_min(0), block_size)
    out.catch_slots.view(rows, width).copy_(torch.where(fed, slots, -1))
    out.catch_positions.view(rows, width).copy_(torch.where(fed, entries + 1, 0))
    out.catch_tokens.view(rows, width).copy_(torch.where(fed, entry_tokens, 0))
    out.catch_context_lens.copy_(torch.where(live, anchors - 1, 0))
    out.catch_query_lens.copy_(torch.where(live, counts, 0))
    out.catch_ends.copy_(torch.arange(rows, device=device) * width + (counts - 1).clamp_min(0))
    steps = out.chain_slots.shape[0]
    if steps:
        entries = anchors[:, None] - 1 + torch.arange(steps, device=device)  # [S, K - 1]
        slots = _cache_slots(tables, entries.clamp_min(0), block_size)
        out.chain_slots.copy_(torch.where(live[:, None], slots, -1).t())
        out.chain_positions.copy_(torch.where(live[:, None], entries + 1, 0).t())
    out.chain_query_lens.copy_(live.to(torch.int64))
    draws = out.draft_positions.shape[0]
    out.draft_positions.copy_((anchors[:, None] + torch.arange(draws, device=device)).t())
