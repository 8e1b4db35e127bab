"""Triton kernels of the decode path's norms, behind `specdec.models.fused` (imported only for
CUDA tensors): residual add + RMSNorm with each family's numerics (`rms_norm`), and Qwen3's
per-head q/k norm over a fused projection. Each launcher takes the arguments of its `*_ref` twin
in `fused.py`; none syncs with the host (the decode step is captured in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled_norm(x, weight, eps, dim, NUMERICS: tl.constexpr):
    """RMSNorm of one row `x` (any float dtype) by `weight` (float32) with `rms_norm`'s
    numerics (0 LLAMA, 1 FLOAT32_WEIGHT, 2 UNIT_OFFSET), in x's dtype."""
    hidden = x.to(tl.float32)
    mean_square = tl.sum(hidden * hidden, axis=0) / dim
    scaled = hidden * tl.rsqrt(mean_square + eps)
    if NUMERICS == 0:
        out = (weight * scaled.to(x.dtype).to(tl.float32)).to(x.dtype)
    elif NUMERICS == 1:
        out = (weight * scaled).to(x.dtype)
    else:
        out = (scaled * (1.0 + weight)).to(x.dtype)
    return out


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, D]
    residual_ptr,  # [T, D] (read when HAS_RESIDUAL)
    weight_ptr,  # [D]
    out_ptr,  # [T, D] normed
    residual_out_ptr,  # [T, D] x + residual
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUMERICS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * dim + cols, mask=inside, other=0.0)
        # Round the sum to the stream's dtype first, as eager `x + residual` does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * dim + cols, x, mask=inside)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out = _scaled_norm(x, weight, eps, dim, NUMERICS)
    tl.store(out_ptr + row * dim + cols, out, mask=inside)


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    numerics: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        residual_out = x
    else:
        residual = residual.contiguous()
        residual_out = torch.empty_like(x)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            residual_out,
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=triton.next_power_of_2(dim),
            NUMERICS=numerics,
            num_warps=4 if dim <= 4096 else 8,
        )
    return out, residual_out


@triton.jit
def _qk_norm_kernel(
    qkv_ptr,  # [T, (H_q + 2 H_kv) * D], normed in place
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUMERICS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # a query head (< H_q) or a key head
    row_width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    cols = tl.arange(0, BLOCK_D)
    inside = cols < HEAD_DIM
    is_query = head < NUM_HEADS
    src = qkv_ptr + token * row_width + head * HEAD_DIM + cols
    x = tl.load(src, mask=inside, other=0.0)
    is_key = head >= NUM_HEADS
    weight = tl.load(q_weight_ptr + cols, mask=inside & is_query, other=0.0).to(tl.float32)
    weight += tl.load(k_weight_ptr + cols, mask=inside & is_key, other=0.0).to(tl.float32)
    tl.store(src, _scaled_norm(x, weight, eps, HEAD_DIM, NUMERICS), mask=inside)


def qk_norm_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    numerics: int,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    qkv = qkv.contiguous()
    head_dim = q_weight.shape[0]
    if qkv.shape[0]:
        _qk_norm_kernel[(qkv.shape[0], num_heads + num_kv_heads)](
            qkv,
            q_weight,
            k_weight,
            eps,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            NUMERICS=numerics,
            num_warps=1 if head_dim <= 256 else 4,
        )
    return qkv
