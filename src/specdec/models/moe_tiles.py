"""The grouped layout of a mixture-of-experts step: its (token, rank) pairs sorted by expert and
cut into tiles of one expert (`expert_tiles`), in torch operations on the step's device with no
host sync, read by the grouped products (`moe.grouped_experts`, `moe_triton`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Pairs per tile of the grouped product, fixed whatever the step's row count (a row's bits
# depend on the K steps alone: see `moe_triton.py`).
GROUPED_BLOCK_M = 16


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """A step's (token, rank) pairs sorted by expert (stable: by pair index within one), cut
    into tiles of at most GROUPED_BLOCK_M pairs of one expert. Every tensor's size follows the
    step's token count alone (no host sync: a CUDA graph replays it); tiles past the last live
    one are empty (start == end). Pair p is token p // k at rank p % k.

    Attributes:
        pair: [P] int64, P = T x k: the pair at each sorted position.
        token: [P] int64: its token (pair // k).
        position: [P] int64: 0..P-1 (the sorted positions, for products that read or write
            them in order).
        tile_expert: [S] int32: each tile's expert (E - 1 for an empty tile).
        tile_start: [S] int32: its first sorted position.
        tile_end: [S] int32: the end of its expert's positions (its rows: [start, min(start
            + block_m, end))); start >= end for an empty tile.
        block_m: the most pairs per tile (GROUPED_BLOCK_M).
    """

    pair: torch.Tensor
    token: torch.Tensor
    position: torch.Tensor
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    block_m: int


def max_tiles(num_pairs: int, num_experts: int, block_m: int = GROUPED_BLOCK_M) -> int:
    """The most tiles P pairs can need: each of at most min(E, P) experts adds at most one
    partial tile (sum of ceil(c_e / M) <= (P + min(E, P) (M - 1)) / M)."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def expert_tiles(
    experts: torch.Tensor, num_experts: int, block_m: int = GROUPED_BLOCK_M
) -> ExpertTiles:
    """The grouped layout of a step's routes, in torch operations on their device (a stable
    sort, a search and a cumulative sum; none reads a value back to the host).

    Args: experts: [T, k] int64 expert ids (`route`). num_experts: E.
    Returns: the `ExpertTiles` of max_tiles(T x k, E) tiles."""
    device = experts.device
    flat = experts.reshape(-1)  # [P]
    num_pairs = flat.shape[0]
    sorted_experts, pair = torch.sort(flat, stable=True)
    ids = torch.arange(num_experts + 1, device=device, dtype=sorted_experts.dtype)
    bounds = torch.searchsorted(sorted_experts, ids)  # [E + 1] first position of each expert
    tile_counts = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m  # [E]
    tiles_end = torch.cumsum(tile_counts, 0)  # [E] inclusive
    tile = torch.arange(max_tiles(num_pairs, num_experts, block_m), device=device)
    tile_expert = torch.searchsorted(tiles_end, tile, right=True)  # [S]; E: past the last
    live = tile_expert < num_experts
    expert = tile_expert.clamp(max=num_experts - 1)
    first_tile = tiles_end[expert] - tile_counts[expert]
    tile_start = bounds[expert] + (tile - first_tile) * block_m
    tile_end = torch.where(live, bounds[expert + 1], tile_start)
    return ExpertTiles(
        pair=pair,
        token=pair // experts.shape[1],
        position=torch.arange(num_pairs, device=device),
        tile_expert=expert.to(torch.int32),
        tile_start=tile_start.to(torch.int32),
        tile_end=tile_end.to(torch.int32),
        block_m=block_m,
    )
