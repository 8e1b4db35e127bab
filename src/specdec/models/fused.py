"""Fused GPU kernels of the decode/verify forward pass, each with a PyTorch twin.

Four kernels cover everything between the GEMMs of a Llama layer: residual add + RMSNorm (with each
family's norm numerics, and Qwen3's per-head q/k norm as a fifth), RoPE + K/V
cache write, SwiGLU's silu(gate) * up (GeGLU's gelu_tanh(gate) * up), and paged attention for
sequences that each bring a few query tokens (decode: 1; verify: K + 1; within a sliding window,
with soft-capped scores, where the layer has them). Launch counts, not arithmetic, bound a
small-batch decode step, so fusing these keeps a CUDA-graphed step close to its weight-read floor.
Every public function dispatches to Triton for CUDA tensors and to its `*_ref` twin otherwise; they
agree up to floating-point rounding order (checked by tests/parity). Nothing here allocates cache
blocks or draws randomness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models.attention import DecodeMetadata, to_cache_dtype
from specdec.models.rms_norm import LLAMA, rms_norm_values
from specdec.models.split_kv import (
    check_tree_window,
    split_kv_decode_attention,
    window_positions_ref,
)


# --------------------------------------------------------------------------- PyTorch twins
def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    numerics: int = LLAMA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) with HF's numerics: the sum is rounded to x's
    dtype, normalised in float32, and scaled by the weight as the family does (`rms_norm`:
    Llama casts back, then scales).

    Args:
        x: [T, D] input (the previous sublayer's output, or the embeddings).
        residual: [T, D] residual stream, or None (then the residual is x itself).
        weight: [D] norm weight.
        eps: RMSNorm epsilon.
        numerics: `rms_norm.NUMERICS` (LLAMA, FLOAT32_WEIGHT or UNIT_OFFSET).

    Returns:
        (normed [T, D], new residual [T, D]), both in x's dtype.
    """
    summed = x if residual is None else x + residual
    if numerics == LLAMA and summed.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same products in one call (bit for bit: x * rsqrt(mean(x^2) + eps), then * w):
        # on the CPU decode path each Python-level operation counts.
        return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed
    return rms_norm_values(summed, weight, eps, numerics), summed


def qk_norm_ref(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    numerics: int,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Qwen3's q/k RMSNorm over each head of a fused projection: [T, (H_q + 2 H_kv) D] in, the
    same layout out with every query head normed by `q_weight` [D] and every key head by
    `k_weight` [D] (values as they are)."""
    head_dim = q_weight.shape[0]
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    query, key, value = qkv.split(sizes, dim=-1)
    heads = (-1, head_dim)
    query = rms_norm_values(query.unflatten(-1, heads), q_weight, eps, numerics).flatten(-2)
    key = rms_norm_values(key.unflatten(-1, heads), k_weight, eps, numerics).flatten(-2)
    return torch.cat([query, key, value], dim=-1)


def rope_write_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotates queries and keys by their positions ("rotate half" RoPE, computed in float32) and
    writes keys and values to their cache slots.

    Args:
        qkv: [T, (H_q + 2 H_kv) * D] fused q/k/v projections.
        positions: [T] int64 absolute positions.
        inv_freq: [D / 2] float32 RoPE inverse frequencies, or [T, D / 2]: each token's own
            (longrope's short or long factors, by position).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches.
        slot_mapping: [T] int64 flat cache slot of each token (-1: not written).
        num_heads, num_kv_heads: H_q, H_kv.

    Returns:
        [T, H_q, D] rotated queries, in qkv's dtype.

    Mutates: the `k_cache` / `v_cache` slots named by `slot_mapping`.
    """
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    freqs = positions[:, None].to(torch.float32) * inv_freq.to(torch.float32)  # [T, D / 2]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]  # [T, 1, D / 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.to(torch.float32).chunk(2, dim=-1)
        out = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return out.to(qkv.dtype)

    query = rotate(heads[:, :num_heads])
    key = rotate(heads[:, num_heads : num_heads + num_kv_heads])
    value = heads[:, num_heads + num_kv_heads :]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(value[keep], v_cache.dtype)
    return query


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] (gate | up) -> [T, F] silu(gate) * up, each rounded to the input dtype as eager
    PyTorch does."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] (gate | up) -> [T, F] gelu_tanh(gate) * up (GeGLU, Gemma's MLP), each rounded to
    the input dtype as eager PyTorch does."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its cached context, with a dense
    mask (the reference of the decode kernels, in another summation order).

    Args:
        query: [B * Q, H_q, D] rotated queries in the uniform layout of `meta`.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches, already holding
            the new tokens' K/V.
        meta: the step's decode metadata.
        scale: softmax scale.
        sliding_window: if set, a query at position p sees keys at positions > p -
            sliding_window; under a tree mask p is a live row's own position (`positions`: a
            node sits at its depth, not its index), and the region must fit the window.
        softcap: if set, scores = softcap * tanh(scores / softcap) after the scale and before
            the mask (Gemma 2).
        positions: [B * Q] int64 rows' positions (read for a tree step under a window).

    Returns:
        [B * Q, H_q, D] in query's dtype; rows of inert sequences (context 0), and padding rows
        that see no key (past the window), are 0.
    """
    check_tree_window(meta, sliding_window, positions)
    num_seqs = meta.context_lens.shape[0]
    q_per_seq = meta.query_per_seq
    num_heads = query.shape[1]
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.zeros_like(query)
    context_lens = meta.context_lens.tolist()
    query_lens = meta.query_lens.tolist()
    for b in range(num_seqs):
        ctx = context_lens[b]
        if ctx == 0:
            continue
        num_blocks = -(-ctx // block_size)
        blocks = meta.block_tables[b, :num_blocks].to(torch.int64)
        keys = k_cache[blocks].flatten(0, 1)[:ctx].to(torch.float32)  # [S, H_kv, D]
        values = v_cache[blocks].flatten(0, 1)[:ctx].to(torch.float32)
        rows = query[b * q_per_seq : (b + 1) * q_per_seq].to(torch.float32)  # [Q, H_q, D]
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [S, H_q, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", rows, keys) * scale  # [H_q, Q, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = ctx - query_lens[b] + torch.arange(q_per_seq, device=query.device)
        visible = torch.arange(ctx, device=query.device)[None] <= query_pos[:, None]  # [Q, S]
        if meta.tree_mask is not None:  # the last W keys are a tree region
            region = meta.tree_mask[b].to(query.device, torch.bool)  # [Q, W] (nonzero: seen)
            prefix = ctx - region.shape[1]
            if prefix < 0:  # a context shorter than the region: its first keys do not exist
                region, prefix = region[:, -prefix:], 0
            visible = visible.clone()
            visible[:, prefix:] = region
        if sliding_window is not None:
            keys_pos = torch.arange(ctx, device=query.device)[None]
            window_pos = window_positions_ref(meta, b, ctx, query_lens[b], positions)
            visible = visible & (keys_pos > window_pos.to(query.device)[:, None] - sliding_window)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        weights = scores.softmax(dim=-1)
        if sliding_window is not None:  # padding rows past the window see no key: 0, not NaN
            weights = weights.nan_to_num(0.0)
        out[b * q_per_seq : (b + 1) * q_per_seq] = torch.einsum("hqs,shd->qhd", weights, values).to(
            query.dtype
        )
    return out


# --------------------------------------------------------------------------- dispatch
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    numerics: int = LLAMA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `add_rms_norm_ref`; one fused kernel on CUDA."""
    if not x.is_cuda:
        return add_rms_norm_ref(x, residual, weight, eps, numerics)
    from specdec.models import norm_triton

    return norm_triton.add_rms_norm_triton(x, residual, weight, eps, numerics)


def qk_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    numerics: int,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """See `qk_norm_ref`; one kernel on CUDA (in place: the returned tensor is `qkv`, made
    contiguous first)."""
    if not qkv.is_cuda:
        return qk_norm_ref(qkv, q_weight, k_weight, eps, numerics, num_heads, num_kv_heads)
    from specdec.models import norm_triton

    return norm_triton.qk_norm_triton(
        qkv, q_weight, k_weight, eps, numerics, num_heads, num_kv_heads
    )


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """See `rope_write_kv_ref`; one fused kernel on CUDA."""
    if not qkv.is_cuda:
        return rope_write_kv_ref(
            qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
        )
    from specdec.models import fused_triton

    return fused_triton.rope_write_kv_triton(
        qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See `silu_mul_ref`; one fused kernel on CUDA."""
    if not gate_up.is_cuda:
        return silu_mul_ref(gate_up)
    from specdec.models import fused_triton

    return fused_triton.silu_mul_triton(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See `gelu_tanh_mul_ref`; one fused kernel on CUDA (tanh through exp: the twin's
    values up to float32 rounding)."""
    if not gate_up.is_cuda:
        return gelu_tanh_mul_ref(gate_up)
    from specdec.models import fused_triton

    return fused_triton.gelu_tanh_mul_triton(gate_up)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `paged_decode_attention_ref`; one kernel per step and layer on CUDA (no host sync, so
    it can be captured in a CUDA graph). Metadata with `num_partitions` runs the split-KV
    kernels instead (`split_kv.py`: long contexts; a tree mask too)."""
    options = dict(sliding_window=sliding_window, softcap=softcap, positions=positions)
    if meta.num_partitions:
        return split_kv_decode_attention(query, k_cache, v_cache, meta, scale, **options)
    if not query.is_cuda:
        return paged_decode_attention_ref(query, k_cache, v_cache, meta, scale, **options)
    from specdec.models import fused_triton

    return fused_triton.paged_decode_attention_triton(
        query, k_cache, v_cache, meta, scale, **options
    )
