"""The Triton kernel behind `specdec.models.linear` (imported only for CUDA tensors, or under
Triton's CPU interpreter): y = x W^T (+ b) whose every row is computed the same way whatever
the number of rows.

One program per (BLOCK_M rows, BLOCK_N columns) tile walks K in BLOCK_K steps from 0 upwards,
accumulating in float32 through `tl.dot`'s accumulator, with no split over K. On the H200 an
output's bits then depend on K alone: ten tile shapes (BLOCK_M 16-128, BLOCK_N 32-256, BLOCK_K
64-128, 4 or 8 warps) and every row count gave the same bits for every row (benchmarks/probes/
probe_batch_invariance.py; tests/parity checks the tiles this file uses). So the tile can follow
the row count for speed, while a row's value never depends on the batch it is in (cuBLAS picks
its algorithm, split-K included, by the row count: a decode row's logits would change with what
shares its step). K is compile-time (one variant per weight depth); row counts are not
specialised on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.models.row_classes import LINEAR_ROW_TIERS
from specdec.triton_specialization import unspecialized


@triton.jit(**unspecialized(ints=("num_rows", "x_stride", "out_stride")))
def _linear_kernel(
    x_ptr,  # [M, K] rows with stride x_stride, unit stride along K
    weight_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] rows with stride out_stride
    num_rows,
    num_cols,
    x_stride,
    out_stride,
    DEPTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    inner = tl.arange(0, BLOCK_K)
    live_row = rows < num_rows
    live_col = cols < num_cols
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * DEPTH
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, DEPTH, BLOCK_K):
        k = start + inner
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=live_row[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=live_col[:, None], other=0.0)
        else:
            live_k = k < DEPTH
            x = tl.load(x_rows + k[None, :], mask=live_row[:, None] & live_k[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=live_col[:, None] & live_k[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)  # [BLOCK_M, BLOCK_N] float32
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=live_col, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_row[:, None] & live_col[None, :])


@dataclass(frozen=True, slots=True)
class LinearTile:
    """A launch shape of `_linear_kernel` (rows, columns and depth per step, warps, stages)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def linear_tile(num_rows: int, num_cols: int, depth: int) -> LinearTile:
    """The launch shape for [num_rows, depth] x [num_cols, depth]^T (speed only: every shape
    gives a row the same bits). From the H200 sweep (`probe_batch_invariance.py --parts tune`,
    graph replays of the SmolLM2 and Llama-3-8B weights): decode-sized products want many
    narrow column tiles and deep K steps, prefill-sized ones wide tiles."""
    small, medium, large = LINEAR_ROW_TIERS  # (the warm-up compiles each tier's variants)
    if num_rows <= small:
        if num_cols <= 8192 and depth >= 2048:
            # The 2,048- to 4,096-deep products of 8B and MoE shapes (H200, s38, graph replays
            # at 1 and 8 rows: 1.1-1.45x the 16-column tile's speed, the same bits).
            block_n = 16 if num_cols <= 2048 else 32
            return LinearTile(16, block_n, 512 if depth >= 4096 else 256, 4, 3)
        block_n = 16 if num_cols <= 8192 else 32 if num_cols <= 32768 else 64
        return LinearTile(16, block_n, 256 if depth >= 512 else 128, 4, 3)
    if num_rows <= medium:
        if num_cols > 8192:
            return LinearTile(64, 128, 128, 4, 3)
        return LinearTile(16, 32 if num_cols <= 1024 else 64, 128, 4, 3)
    if num_rows <= large:
        return LinearTile(64, 128, 64, 8, 3)
    return LinearTile(128, 128, 64, 8, 3)


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) with rows independent of the row count (see the module docstring).

    Args:
        x: [M, K] activations (unit stride along K; rows may be strided).
        weight: [N, K] in x's dtype.
        bias: [N] or None.
        out_dtype: the output's dtype (None: x's); the float32 accumulator is rounded to it
            once (float32: stored as summed).

    Returns: [M, N] in out_dtype.
    """
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(num_rows, num_cols, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tile = linear_tile(num_rows, num_cols, depth)
    launch_linear(x, weight, bias, out, tile)
    return out


def launch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tile: LinearTile,
) -> None:
    """One launch of `_linear_kernel` over contiguous-K x [M, K], weight [N, K] into out [M, N]
    (the tuning probe calls it with other tiles)."""
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    grid = (triton.cdiv(num_cols, tile.block_n), triton.cdiv(num_rows, tile.block_m))
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        num_rows,
        num_cols,
        x.stride(0),
        out.stride(0),
        DEPTH=depth,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        EVEN_K=depth % tile.block_k == 0,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
