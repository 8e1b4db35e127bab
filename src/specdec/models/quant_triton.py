"""Triton kernels behind `specdec.models.quant` on CUDA: weight-only matrix products with group-
quantized integer (4- or 8-bit) or FP8 e4m3 weights, and their dequantization to a float dtype.

Each weight tile is dequantized in registers exactly as `QuantizedWeight.dequantize` does
(values * scale + zero in float32), rounded to the activation dtype, and multiplied with float32
accumulation: the twin is `quant_linear_ref` on the rounded weight. No host syncs and grids that
depend only on shapes, so the products are captured in CUDA graphs. Imported only for CUDA
tensors (tests may run the kernels under the Triton interpreter on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# BITS of the kernels: 4 (two values per byte), 8 (int8), 0 (float8_e4m3fn, one scale per row).
FP8_BITS = 0


@triton.jit
def _weight_tile(
    w_ptr,  # [N, K // 2] uint8 (BITS 4), [N, K] int8 (BITS 8) or float8 (BITS 0)
    scale_ptr,  # [N, K // GROUP] float32, or [N] for FP8
    zero_ptr,  # [N, K // GROUP] float32 (read when HAS_ZERO)
    rows,  # [BLOCK_N] output rows of the tile
    cols,  # [BLOCK_K] input columns of the tile
    inside_rows,  # [BLOCK_N] bool
    inside_cols,  # [BLOCK_K] bool
    K,
    value_low,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    """The [BLOCK_N, BLOCK_K] float32 weight tile: (value + value_low) * scale + zero, or an
    FP8 value times its row's scale."""
    mask = inside_rows[:, None] & inside_cols[None, :]
    if BITS == 0:
        values = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
        row_scale = tl.load(scale_ptr + rows, mask=inside_rows, other=0.0)
        weight = values.to(tl.float32) * row_scale[:, None]
    else:
        if BITS == 4:
            packed = tl.load(
                w_ptr + rows[:, None] * (K // 2) + cols[None, :] // 2, mask=mask, other=0
            )
            shift = (cols[None, :] % 2) * 4
            values = ((packed.to(tl.int32) >> shift) & 15) + value_low
        else:
            values = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0)
            values = values.to(tl.int32)
        at = rows[:, None] * (K // GROUP) + cols[None, :] // GROUP
        weight = values.to(tl.float32) * tl.load(scale_ptr + at, mask=mask, other=0.0)
        if HAS_ZERO:
            weight = weight + tl.load(zero_ptr + at, mask=mask, other=0.0)
    return weight


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # see _weight_tile
    scale_ptr,
    zero_ptr,
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_om,
    value_low,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_m = rows_m < M
    inside_n = rows_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        inside_k = cols < K
        x = tl.load(
            x_ptr + rows_m[:, None] * stride_xm + cols[None, :],
            mask=inside_m[:, None] & inside_k[None, :],
            other=0.0,
        )
        weight = _weight_tile(
            w_ptr,
            scale_ptr,
            zero_ptr,
            rows_n,
            cols,
            inside_n,
            inside_k,
            K,
            value_low,
            GROUP,
            BITS,
            HAS_ZERO,
        )
        weight = weight.to(x_ptr.dtype.element_ty)  # the weight as the twin rounds it
        if USE_DOT:
            acc = tl.dot(x, tl.trans(weight), acc)
        else:  # a few rows (decode): FMAs, no tensor-core padding
            acc += tl.sum(x.to(tl.float32)[:, None, :] * weight.to(tl.float32)[None, :, :], axis=2)
    out = out_ptr + rows_m[:, None] * stride_om + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside_m[:, None] & inside_n[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr,  # see _weight_tile
    scale_ptr,
    zero_ptr,
    out_ptr,  # [N, K]
    N,
    K,
    value_low,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside_rows, inside_cols = rows < N, cols < K
    weight = _weight_tile(
        w_ptr,
        scale_ptr,
        zero_ptr,
        rows,
        cols,
        inside_rows,
        inside_cols,
        K,
        value_low,
        GROUP,
        BITS,
        HAS_ZERO,
    )
    out = out_ptr + rows[:, None] * K + cols[None, :]
    tl.store(
        out, weight.to(out_ptr.dtype.element_ty), mask=inside_rows[:, None] & inside_cols[None, :]
    )


def _operands(tensors: dict[str, torch.Tensor], meta: dict) -> tuple:
    """(w, scale, zero, value_low, group, bits, has_zero) of a triton_int / triton_fp8 weight."""
    if meta["bits"] == FP8_BITS:
        scale = tensors["scale"]
        return tensors["values"], scale, scale, 0, 1, FP8_BITS, False
    zero = tensors.get("zero")
    scale = tensors["scale"]
    return (
        tensors["data"],
        scale,
        scale if zero is None else zero,
        meta["value_low"],
        meta["group_size"],
        meta["bits"],
        zero is not None,
    )


def _matmul_plan(num_rows: int) -> tuple[int, int, int, bool, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, use tl.dot, num_warps, num_stages): one tile shape for every
    M, so a row's accumulation order (and result) does not depend on how many rows the product
    has (a verify row equals the decode row of the same token)."""
    del num_rows
    # The fastest of nine plans at one and eight rows on the H200's 8B shapes (FP8: 0.66-0.9x
    # the bfloat16 product; benchmarks/probes/probe_quant_kernels.py).
    return 16, 32, 256, True, 4, 3


def quant_matmul_triton(
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    meta: dict,
    shape: tuple[int, int],
    plan: tuple[int, int, int, bool, int, int] | None = None,
) -> torch.Tensor:
    """x @ W^T for a weight in the triton_int / triton_fp8 layout.

    Args:
        x: [M, K] activations (float16, bfloat16 or float32).
        tensors, meta: the weight's tensors and constants (`QuantizedWeight`).
        shape: (N, K).
        plan: a tile plan other than `_matmul_plan`'s (probes).

    Returns: [M, N] in x's dtype.
    """
    num_rows, num_cols = x.shape
    num_out = shape[0]
    x = x.contiguous()
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    w, scale, zero, value_low, group, bits, has_zero = _operands(tensors, meta)
    block_m, block_n, block_k, use_dot, num_warps, num_stages = plan or _matmul_plan(num_rows)
    grid = (triton.cdiv(num_out, block_n), triton.cdiv(num_rows, block_m))
    _quant_matmul_kernel[grid](
        x,
        w,
        scale,
        zero,
        out,
        num_rows,
        num_out,
        num_cols,
        x.stride(0),
        out.stride(0),
        value_low,
        GROUP=group,
        BITS=bits,
        HAS_ZERO=has_zero,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_DOT=use_dot,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def dequantize_triton(
    tensors: dict[str, torch.Tensor], meta: dict, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (`QuantizedWeight.dequantize` rounded to `dtype`)."""
    num_out, num_cols = shape
    w, scale, zero, value_low, group, bits, has_zero = _operands(tensors, meta)
    out = torch.empty(num_out, num_cols, dtype=dtype, device=w.device)
    block_n, block_k = 32, 128
    grid = (triton.cdiv(num_out, block_n), triton.cdiv(num_cols, block_k))
    _dequantize_kernel[grid](
        w,
        scale,
        zero,
        out,
        num_out,
        num_cols,
        value_low,
        GROUP=group,
        BITS=bits,
        HAS_ZERO=has_zero,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
