"""The Triton kernels of a mixture-of-experts step's bookkeeping (imported only for CUDA tensors,
or under Triton's CPU interpreter): every token's top-k routes (`top_k_routes_triton`), the
grouped layout of the step's (token, rank) pairs (`expert_tiles_triton`), and every token's sum
over its experts' outputs (`combine_ranks_triton`).

Each is one launch where PyTorch took a run of small kernels: a stable sort, slices, a sum and a
division for the routes; a sort, two searches, two cumulative sums and a dozen index operations
for the layout; k products, k - 1 sums and two casts for the combination (about 60 of a layer's
70 launches, 3,000 a token for the Qwen3-30B-A3B shape: BENCHMARKS area 10, s28). Each gives
its twin's bits (`moe.top_k_routes_ref`, `moe_tiles.expert_tiles_ref`, `moe.combine_ranks_ref`):
the integers exactly, the floats by the same operations in the same order (the renormaliser
and the combination summed rank by rank, best expert first; IEEE division; no fused
multiply-add: `enable_fp_fusion=False`). None depends on the step's token count for a token's
values, and none syncs with the host: a CUDA graph replays them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specdec.models.moe_tiles import ExpertTiles, max_tiles

# The interpreter's float32 -> bfloat16 cast truncates: there the combination stores float32 and
# the launcher rounds to nearest even (as the GPU's store does).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The most tokens per program of the routes (fewer for a step of fewer tokens; speed only: a
# token's routes never depend on it).
ROUTE_BLOCK_TOKENS = 16
# Hidden columns per program of the combination (speed only).
COMBINE_BLOCK_COLS = 1024
# The pair counts the layout kernel is compiled for (one program sorts a step's pairs); a step
# with more pairs takes the twin (the same integers: the layout is a function of the routes).
TILE_PAIR_TIERS = (64, 512, 2048)


@triton.jit
def _top_k_routes_kernel(
    probs_ptr,  # [T, E] float32, contiguous
    weights_ptr,  # [T, TOP_K] float32 out
    experts_ptr,  # [T, TOP_K] int64 out
    num_tokens,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live_token = tokens < num_tokens
    ids = tl.arange(0, BLOCK_E)
    rows = tokens.to(tl.int64)[:, None] * NUM_EXPERTS
    # Padding reads as -1: below every probability, so never chosen.
    probs = tl.load(
        probs_ptr + rows + ids[None, :],
        mask=live_token[:, None] & (ids < NUM_EXPERTS)[None, :],
        other=-1.0,
    )
    ranks = tl.arange(0, BLOCK_K)
    kept = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for rank in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)  # [BLOCK_T]
        # Ties to the lower expert id (the twin's stable descending sort).
        expert = tl.min(tl.where(probs == best[:, None], ids[None, :], BLOCK_E), axis=1)
        kept = tl.where(ranks[None, :] == rank, best[:, None], kept)
        chosen = tl.where(ranks[None, :] == rank, expert[:, None], chosen)
        total = total + best  # rank by rank, best first (0 + w exactly w: w >= 0)
        probs = tl.where(ids[None, :] == expert[:, None], -1.0, probs)
    if RENORMALIZE:
        kept = tl.math.div_rn(kept, tl.broadcast_to(total[:, None], (BLOCK_T, BLOCK_K)))
    out = tokens.to(tl.int64)[:, None] * TOP_K + ranks[None, :]
    live = live_token[:, None] & (ranks < TOP_K)[None, :]
    tl.store(weights_ptr + out, kept, mask=live)
    tl.store(experts_ptr + out, chosen.to(tl.int64), mask=live)


def top_k_routes_triton(
    probs: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `moe.top_k_routes_ref`: probs [T, E] float32 -> ([T, k] float32 weights, [T, k]
    int64 expert ids), one launch."""
    num_tokens, num_experts = probs.shape
    probs = probs if probs.is_contiguous() else probs.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=probs.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=probs.device)
    if num_tokens == 0:
        return weights, experts
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(ROUTE_BLOCK_TOKENS, 8192 // block_e, triton.next_power_of_2(num_tokens)))
    _top_k_routes_kernel[(triton.cdiv(num_tokens, block_t),)](
        probs,
        weights,
        experts,
        num_tokens,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if block_t * block_e >= 1024 else 1,  # (a decode step's few tokens: one warp)
        enable_fp_fusion=False,
    )
    return weights, experts


@triton.jit
def _expert_tiles_kernel(
    experts_ptr,  # [P] int64: each pair's expert (pair p: token p // TOP_K, rank p % TOP_K)
    pair_ptr,  # [P] int64 out: the pair at each sorted position
    token_ptr,  # [P] int64 out: its token
    position_ptr,  # [P] int64 out: 0..P-1
    tile_expert_ptr,  # [S] int32 out
    tile_start_ptr,  # [S] int32 out
    tile_end_ptr,  # [S] int32 out
    num_pairs,
    num_tiles,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    slots = tl.arange(0, BLOCK_P)
    live = slots < num_pairs
    # Padding slots take expert E: they sort last and fall in a bin no expert reads.
    expert = tl.load(experts_ptr + slots, mask=live, other=NUM_EXPERTS).to(tl.int32)
    # Sorted by expert, then by pair index (the keys are distinct: the twin's stable sort).
    keys = tl.sort(expert * BLOCK_P + slots)
    pair = keys % BLOCK_P
    tl.store(pair_ptr + slots, pair.to(tl.int64), mask=live)
    tl.store(token_ptr + slots, (pair // TOP_K).to(tl.int64), mask=live)
    tl.store(position_ptr + slots, slots.to(tl.int64), mask=live)
    ids = tl.arange(0, BLOCK_E)
    real = ids < NUM_EXPERTS
    counts = tl.where(real, tl.histogram(expert, BLOCK_E), 0)  # [BLOCK_E] pairs per expert
    bounds = tl.cumsum(counts, 0) - counts  # each expert's first sorted position
    tile_counts = (counts + BLOCK_M - 1) // BLOCK_M
    first_tile = tl.cumsum(tile_counts, 0) - tile_counts
    # Each expert writes its own tiles, the j-th of all experts at once (an expert has at most
    # BLOCK_P / BLOCK_M of them).
    for j in range(0, BLOCK_P // BLOCK_M):
        mine = real & (j < tile_counts)
        tile = first_tile + j
        tl.store(tile_expert_ptr + tile, ids, mask=mine)
        tl.store(tile_start_ptr + tile, bounds + j * BLOCK_M, mask=mine)
        tl.store(tile_end_ptr + tile, bounds + counts, mask=mine)
    # Tiles past the last live one: the last expert's numbering continued, empty (start == end).
    last = ids == NUM_EXPERTS - 1
    last_bound = tl.sum(tl.where(last, bounds, 0), 0)
    last_first = tl.sum(tl.where(last, first_tile, 0), 0)
    rest = tl.arange(0, BLOCK_S)
    dead = (rest >= tl.sum(tile_counts, 0)) & (rest < num_tiles)
    start = last_bound + (rest - last_first) * BLOCK_M
    tl.store(tile_expert_ptr + rest, tl.full((BLOCK_S,), NUM_EXPERTS - 1, tl.int32), mask=dead)
    tl.store(tile_start_ptr + rest, start, mask=dead)
    tl.store(tile_end_ptr + rest, start, mask=dead)


def tile_pair_tier(num_pairs: int) -> int | None:
    """The smallest compiled pair count holding `num_pairs` (None: more than the largest)."""
    return next((tier for tier in TILE_PAIR_TIERS if num_pairs <= tier), None)


def expert_tiles_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """See `moe_tiles.expert_tiles_ref`, in one launch of one program (experts: [T, k] int64
    with T x k <= the largest of TILE_PAIR_TIERS)."""
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    block_p = tile_pair_tier(num_pairs)
    if block_p is None:
        raise ValueError(f"{num_pairs} pairs exceed the layout kernel's {TILE_PAIR_TIERS[-1]}")
    device = experts.device
    num_tiles = max_tiles(num_pairs, num_experts, block_m)
    pair, token, position = (
        torch.empty(num_pairs, dtype=torch.int64, device=device) for _ in range(3)
    )
    tile_expert, tile_start, tile_end = (
        torch.empty(num_tiles, dtype=torch.int32, device=device) for _ in range(3)
    )
    if num_pairs:
        flat = experts.reshape(-1)
        _expert_tiles_kernel[(1,)](
            flat if flat.is_contiguous() else flat.contiguous(),
            pair,
            token,
            position,
            tile_expert,
            tile_start,
            tile_end,
            num_pairs,
            num_tiles,
            TOP_K=top_k,
            NUM_EXPERTS=num_experts,
            BLOCK_M=block_m,
            BLOCK_P=block_p,
            BLOCK_E=triton.next_power_of_2(num_experts + 1),
            BLOCK_S=triton.next_power_of_2(max(1, max_tiles(block_p, num_experts, block_m))),
            num_warps=4 if block_p <= 512 else 8,
        )
    return ExpertTiles(
        pair=pair,
        token=token,
        position=position,
        tile_expert=tile_expert,
        tile_start=tile_start,
        tile_end=tile_end,
        block_m=block_m,
    )


@triton.jit
def _combine_ranks_kernel(
    outputs_ptr,  # [T x TOP_K, D] expert outputs by (token, rank), contiguous
    weights_ptr,  # [T, TOP_K] float32
    out_ptr,  # [T, D]
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = cols < HIDDEN
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for rank in tl.static_range(TOP_K):
        row = token * TOP_K + rank
        weight = tl.load(weights_ptr + row)
        value = tl.load(outputs_ptr + row * HIDDEN + cols, mask=live, other=0.0).to(tl.float32)
        if rank == 0:  # noqa: SIM108 (a compile-time branch)
            total = value * weight  # (not 0 + v w: a -0 product would turn +0)
        else:
            total = total + value * weight
    tl.store(out_ptr + token * HIDDEN + cols, total.to(out_ptr.dtype.element_ty), mask=live)


def combine_ranks_triton(
    outputs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """See `moe.combine_ranks_ref`: outputs [T x k, D], weights [T, k] float32 -> [T, D] in
    `dtype`, one launch."""
    num_tokens, top_k = weights.shape
    hidden = outputs.shape[-1]
    outputs = outputs if outputs.is_contiguous() else outputs.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    widen = INTERPRET and dtype != torch.float32
    out = torch.empty(
        num_tokens, hidden, dtype=torch.float32 if widen else dtype, device=outputs.device
    )
    if num_tokens == 0:
        return out.to(dtype)
    grid = (num_tokens, triton.cdiv(hidden, COMBINE_BLOCK_COLS))
    _combine_ranks_kernel[grid](
        outputs,
        weights,
        out,
        HIDDEN=hidden,
        TOP_K=top_k,
        BLOCK_D=COMBINE_BLOCK_COLS,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out.to(dtype)
