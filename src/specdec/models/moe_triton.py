"""The Triton kernel behind `specdec.models.moe.grouped_linear` (imported only for CUDA tensors,
or under Triton's CPU interpreter): one launch computes the rows of every expert, each row
x W_e^T of its own expert, the same way whatever the number of rows or experts in the step.

One program per (tile of at most `moe_tiles.GROUPED_BLOCK_M` pairs of one expert, BLOCK_N
columns): it gathers its rows of x through `source`, walks K in `moe.GROUPED_BLOCK_K` steps from
0 upwards into a float32 `tl.dot` accumulator with no split over K (as `linear_triton.py`'s
dense kernel, whose H200 sweep found an output's bits to depend on K alone), rounds once, and
scatters the rows through `dest`. The tile is fixed, never chosen from the row count, so a row's
bits never depend on which rows share its step or its tile. The tiles come from
`moe_tiles.expert_tiles` (device-side, sized by the token count alone: a CUDA graph replays it);
empty tiles return at once. It never routes, activates or combines (`moe.grouped_experts` does,
around two launches)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from specdec.models.moe_tiles import ExpertTiles

# Two interpreter gaps for 16-bit floats: its `tl.dot` multiplies bfloat16 tiles as their uint16
# storage, and its float32 -> bfloat16 cast truncates. There the kernel widens the tiles to
# float32 first (exact products either way; on the GPU the dot stays bfloat16) and stores float32
# that the launcher rounds to nearest even (as the GPU's store does).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Columns per program (speed only: a row's bits do not depend on it).
GROUPED_BLOCK_N = 64


@triton.jit
def _grouped_linear_kernel(
    x_ptr,  # [R, K] source rows with stride x_stride, unit stride along K
    weight_ptr,  # [E, N, K] contiguous: expert e's [N, K] weight at e * N * K
    out_ptr,  # [num_out_rows, N] rows with stride out_stride
    source_ptr,  # [P] int64: the x row of each sorted position
    dest_ptr,  # [P] int64: the out row of each sorted position
    tile_expert_ptr,  # [S] int32
    tile_start_ptr,  # [S] int32: first sorted position of the tile
    tile_end_ptr,  # [S] int32: end of its expert's positions (start >= end: empty)
    x_stride,
    out_stride,
    NUM_COLS: tl.constexpr,
    DEPTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    WIDEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start < end:
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        positions = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        live_row = positions < end
        source = tl.load(source_ptr + positions, mask=live_row, other=0)  # [BLOCK_M] int64
        dest = tl.load(dest_ptr + positions, mask=live_row, other=0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        live_col = cols < NUM_COLS
        inner = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + source.to(tl.int64)[:, None] * x_stride
        # W_e^T loaded as [BLOCK_K, BLOCK_N] (no `tl.trans`: the interpreter's dot of a
        # transposed numpy view takes another summation path than the twin's GEMM).
        w_cols = weight_ptr + expert * (NUM_COLS * DEPTH) + cols.to(tl.int64)[None, :] * DEPTH
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, DEPTH, BLOCK_K):
            k = k_start + inner
            if EVEN_K:
                x = tl.load(x_rows + k[None, :], mask=live_row[:, None], other=0.0)
                w = tl.load(w_cols + k[:, None], mask=live_col[None, :], other=0.0)
            else:
                live_k = k < DEPTH
                x = tl.load(
                    x_rows + k[None, :], mask=live_row[:, None] & live_k[None, :], other=0.0
                )
                w = tl.load(
                    w_cols + k[:, None], mask=live_k[:, None] & live_col[None, :], other=0.0
                )
            if WIDEN:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            if IEEE:  # noqa: SIM108 (the branch `linear_triton.py` compiles, kept as is)
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)  # [BLOCK_M, BLOCK_N] float32
        out = out_ptr + dest.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_row[:, None] & live_col[None, :])


def grouped_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: ExpertTiles,
    source: torch.Tensor,
    dest: torch.Tensor,
    num_out_rows: int,
    block_k: int,
) -> torch.Tensor:
    """out[dest[s]] = x[source[s]] W_e^T for each sorted position s of expert e, in one launch
    (twin: `moe.grouped_linear_ref`, whose bits it gives under the interpreter).

    Args:
        x: [R, K] source rows (unit stride along K; rows may be strided).
        weight: [E, N, K] stacked expert weights in x's dtype.
        tiles: the step's layout (`moe_tiles.expert_tiles`).
        source, dest: [P] int64 row of x read / row of out written at each sorted position.
        num_out_rows: out's rows (every one is some position's dest).
        block_k: the K step (`moe.GROUPED_BLOCK_K`; only a negative control passes another).

    Returns: [num_out_rows, N] in x's dtype.
    """
    _, num_cols, depth = weight.shape  # [E, N, K]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    widen = INTERPRET and x.dtype != torch.float32
    out_dtype = torch.float32 if widen else x.dtype
    out = torch.empty(num_out_rows, num_cols, dtype=out_dtype, device=x.device)
    num_tiles = tiles.tile_start.shape[0]
    if num_tiles == 0 or num_out_rows == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(num_cols, GROUPED_BLOCK_N), num_tiles)
    _grouped_linear_kernel[grid](
        x,
        weight,
        out,
        source,
        dest,
        tiles.tile_expert,
        tiles.tile_start,
        tiles.tile_end,
        x.stride(0),
        out.stride(0),
        NUM_COLS=num_cols,
        DEPTH=depth,
        BLOCK_M=tiles.block_m,
        BLOCK_N=GROUPED_BLOCK_N,
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
        EVEN_K=depth % block_k == 0,
        WIDEN=widen,
        num_warps=4,
        num_stages=3,
    )
    return out.to(x.dtype)
