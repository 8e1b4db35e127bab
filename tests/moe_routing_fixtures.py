"""Inputs and negative controls of the mixture-of-experts bookkeeping kernels' tests
(tests/unit/models/test_moe_routing_triton.py under Triton's interpreter, tests/parity/
test_moe_gpu.py on a GPU): tied probabilities, skewed routes, and each rule broken once (ties to
the higher id, the renormaliser summed worst first, a layout unstable within an expert, the ranks
combined worst first)."""

from __future__ import annotations

import torch

from specdec.models.moe import combine_ranks_ref, top_k_routes_ref
from specdec.models.moe_tiles import ExpertTiles, expert_tiles

TILE_FIELDS = ("pair", "token", "position", "tile_expert", "tile_start", "tile_end")


def tied_probs(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """Softmax probabilities of random logits in which, for every token, experts 3 and 5 share
    the largest logit (an exact tie at rank 0 and 1) and experts 1 and 2 another value."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, 3] = logits[:, 5] = logits.max(dim=-1).values + 1.0
    logits[:, 2] = logits[:, 1]
    return torch.softmax(logits, dim=-1)


def same_tiles(first: ExpertTiles, second: ExpertTiles) -> bool:
    return all(
        getattr(first, name).dtype == getattr(second, name).dtype
        and torch.equal(getattr(first, name), getattr(second, name))
        for name in TILE_FIELDS
    )


def skewed_experts(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """[T, k] distinct expert ids per token, low ids far more often (several tiles for some,
    none for others)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    scores = scores + torch.linspace(1.0, 0.0, num_experts)
    return scores.topk(top_k, dim=-1).indices


def ties_to_the_higher_id(
    probs: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A negative control: the twin over the experts in reverse id order."""
    weights, experts = top_k_routes_ref(probs.flip(-1), top_k, renormalize)
    return weights, probs.shape[-1] - 1 - experts


def renormalized_worst_first(
    probs: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A negative control: the renormaliser summed from the worst rank."""
    weights, experts = top_k_routes_ref(probs, top_k, renormalize=False)
    total = weights[:, -1]
    for rank in range(top_k - 2, -1, -1):
        total = total + weights[:, rank]
    return weights / total[:, None], experts


def unstable_tiles(experts: torch.Tensor, num_experts: int) -> ExpertTiles:
    """A negative control: pairs within an expert in reverse order (the layout of the reversed
    pairs, renumbered)."""
    flat = experts.reshape(-1)
    tiles = expert_tiles(flat.flip(0).view(experts.shape), num_experts)
    pair = flat.numel() - 1 - tiles.pair
    return ExpertTiles(
        pair=pair,
        token=pair // experts.shape[1],
        position=tiles.position,
        tile_expert=tiles.tile_expert,
        tile_start=tiles.tile_start,
        tile_end=tiles.tile_end,
        block_m=tiles.block_m,
    )


def combined_worst_first(
    outputs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A negative control: the ranks combined from the worst."""
    num_tokens, top_k = weights.shape
    flipped = outputs.view(num_tokens, top_k, -1).flip(1).reshape(outputs.shape)
    return combine_ranks_ref(flipped, weights.flip(1), dtype)
