"""Flash-style attention of prefill chunks over the paged KV cache: the dispatch (Triton on CUDA)
and its PyTorch twin `paged_prefill_attention_ref`.

Each sequence's new query tokens attend causally among themselves and fully to its cached prefix
(or to the last `sliding_window` positions), with an online softmax over key tiles of
`PREFILL_BLOCK_N` keys (Dao et al. 2022, FlashAttention, Alg. 1; base-2 exponentials as in
FlashAttention-2): no score matrix is held, so memory is linear in the context. The twin runs the
same tiles in the same order with the same recurrences; it cannot match the kernel bit for bit
(tensor-core summation order, the hardware exp2), so the parity tests state a tolerance. Never
writes the cache, allocates blocks or draws randomness.
"""

from __future__ import annotations

import torch

from specdec.models.attention_tiles import (
    PREFILL_BLOCK_N,
    merge_partial_ref,
    score_scales,
    soft_cap_ref,
    split_kv_partition,
)


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context, tile by tile.

    Args:
        query: [T, H_q, D] queries of the new tokens (after RoPE), sequence after sequence.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches, already holding
            the new tokens' K/V (any float dtype; FP8 values are read as they are, scale 1.0).
        cu_seqlens_q: [B + 1] int exclusive prefix sum of the query lengths.
        context_lens: [B] int tokens in the cache of each sequence, the new ones included; query
            token j of a sequence with q_len new tokens sits at position context_len - q_len + j.
        block_tables: [B, max_blocks] int cache blocks of each sequence (entries past its
            context are never read).
        scale: softmax scale.
        sliding_window: if set, a query at position p sees keys at positions > p - sliding_window.
        softcap: if set, scores = softcap * tanh(scores / softcap) after the scale, before the
            masks (Gemma 2; in base 2 as `attention_tiles.score_scales` states).

    Returns:
        [T, H_q, D] in query's dtype: per tile, scores = (q k^T) * scale * log2(e) in float32,
        m' = max(m, rowmax), p = exp2(s - m'), l = l * exp2(m - m') + rowsum(p),
        acc = acc * exp2(m - m') + p.to(query dtype) @ v; out = acc / l; past one split-KV
        partition of keys, each partition from an empty state, merged in order
        (`attention_tiles.merge_partial_ref`), as the decode kernels do.
    """
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qk_scale, softcap_log2 = score_scales(scale, softcap)
    device = query.device
    out = torch.zeros_like(query)
    cu = cu_seqlens_q.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        blocks = block_tables[b, : -(-context_len // block_size)].to(torch.int64)
        keys = k_cache[blocks].flatten(0, 1)[:context_len]  # [S, H_kv, D]
        values = v_cache[blocks].flatten(0, 1)[:context_len]
        keys = keys.to(torch.float32).to(query.dtype).to(torch.float32)  # as the kernel reads them
        values = values.to(torch.float32).to(query.dtype).to(torch.float32)
        rows = query[start:end].to(torch.float32).view(q_len, num_kv_heads, group, head_dim)
        rows = rows.permute(1, 2, 0, 3)  # [H_kv, G, q_len, D]
        query_pos = context_len - q_len + torch.arange(q_len, device=device)  # [q_len]
        shape = (num_kv_heads, group, q_len)
        merged = (
            torch.full(shape, float("-inf"), device=device),
            torch.zeros(shape, device=device),
            torch.zeros(*shape, head_dim, device=device),
        )
        first_tile = 0
        if sliding_window is not None:
            first_tile = max(context_len - q_len - sliding_window + 1, 0) // PREFILL_BLOCK_N
        num_tiles = -(-context_len // PREFILL_BLOCK_N)
        per_part = split_kv_partition() // PREFILL_BLOCK_N
        # Partitions at the split-KV edges, each from an empty state, merged in order (one
        # partition: the single pass itself).
        for part in range(first_tile // per_part, -(-num_tiles // per_part)):
            row_max = torch.full(shape, float("-inf"), device=device)
            row_sum = torch.zeros(shape, device=device)
            acc = torch.zeros(*shape, head_dim, device=device)
            for tile in range(
                max(part * per_part, first_tile), min((part + 1) * per_part, num_tiles)
            ):
                key_pos = torch.arange(
                    tile * PREFILL_BLOCK_N,
                    min((tile + 1) * PREFILL_BLOCK_N, context_len),
                    device=device,
                )  # [N]
                tile_keys = keys[key_pos].permute(1, 0, 2)[:, None]  # [H_kv, 1, N, D]
                scores = (rows @ tile_keys.transpose(-1, -2)) * qk_scale  # [H_kv, G, q_len, N]
                if softcap is not None:
                    scores = soft_cap_ref(scores, softcap_log2)
                visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, N]
                if sliding_window is not None:
                    visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
                scores = scores.masked_fill(~visible, float("-inf"))
                new_max = torch.maximum(row_max, scores.amax(dim=-1))
                safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
                weights = torch.exp2(scores - safe_max[..., None])
                rescale = torch.exp2(row_max - safe_max)
                row_sum = row_sum * rescale + weights.sum(dim=-1)
                tile_values = values[key_pos].permute(1, 0, 2)[:, None]  # [H_kv, 1, N, D]
                update = weights.to(query.dtype).to(torch.float32) @ tile_values
                acc = acc * rescale[..., None] + update
                row_max = new_max
            merged = merge_partial_ref(*merged, row_max, row_sum, acc)
        _, row_sum, acc = merged
        result = acc / row_sum.clamp_min(1e-30)[..., None]  # [H_kv, G, q_len, D]
        out[start:end] = (
            result.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """See `paged_prefill_attention_ref` (`max_seqlen_q`: the longest query, a host int that
    sizes the kernel's grid); one Triton kernel on CUDA, the twin elsewhere."""
    if not query.is_cuda:
        return paged_prefill_attention_ref(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q,
            context_lens,
            block_tables,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    from specdec.models import prefill_attention_triton

    return prefill_attention_triton.paged_prefill_attention_triton(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        max_seqlen_q,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )
