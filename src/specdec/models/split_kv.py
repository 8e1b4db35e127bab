"""Split-KV (flash-decoding) attention for decode/verify steps at long context: the dispatch
(Triton on CUDA) and its PyTorch twin `split_kv_decode_attention_ref`.

Each sequence's context is cut into partitions of `split_kv_partition()` keys at fixed absolute
positions; a first pass computes one partial (row max, row sum, unnormalised output) per
partition, running exactly the single-pass decode kernel's 64-key online-softmax steps, and a
second pass merges the partials in partition order (Dao et al. 2023, Flash-Decoding), one at a
time (`merge_partial_ref`). The single-pass decode kernel and the prefill kernel cut a context
longer than one partition at the same edges and merge the same way (s33), so a token's row has
the same bits whichever kernel computes it at any context length; a context of one partition is
the single pass itself (its merge takes the partial as it is). The partition a key falls in never
depends on the batch. A launch covers
`meta.num_partitions` partitions per sequence, fixed per CUDA-graph bucket (derived from
max_model_len); programs of partitions past a sequence's context do no work.
A tree verify step's mask (`DecodeMetadata.tree_mask`) applies in the partitions as in the
single-pass kernel; so do a sliding window (partitions wholly before a row's window contribute
nothing: row max -inf, combine weight 0) and soft-capped scores. `split_kv_attention_lse` also
returns each row's log-sum-exp in float32 (for merging with another partial attention of the
same rows: the block drafters' paged context). Never writes the cache or draws randomness.
"""

from __future__ import annotations

import torch

from specdec.models.attention import DecodeMetadata
from specdec.models.attention_tiles import (
    DECODE_BLOCK_N,
    LN2,
    merge_partial_ref,
    score_scales,
    soft_cap_ref,
    split_kv_partition,
)


def num_partitions(max_context_len: int) -> int:
    """Partitions a launch needs to cover contexts of up to `max_context_len` keys."""
    return -(-max_context_len // split_kv_partition())


# Steps filled on the device (device rounds) attend with split-KV when their cache holds contexts
# of at least this many tokens: their contexts are not known on the host, and below it the
# single-pass kernel's occupancy suffices while split-KV's second pass would cost every layer a
# launch. A speed choice only: both kernels merge at the same partition edges (s33).
SPLIT_KV_ROUNDS_FROM = 16384


def step_partitions(max_context_len: int, device: torch.device) -> int:
    """The split-KV partitions of a graphed decode step over a cache of contexts up to
    `max_context_len` keys: enough to cover them on CUDA, 0 (the single-pass kernel) on the
    CPU or when one partition covers them."""
    count = num_partitions(max_context_len) if device.type == "cuda" else 0
    return count if count > 1 else 0


def split_when_unseen(max_context_len: int, device: torch.device) -> bool:
    """Whether steps whose contexts the host cannot see (filled on the device) take split-KV:
    on CUDA from `SPLIT_KV_ROUNDS_FROM` tokens of cache per sequence."""
    return step_partitions(max_context_len, device) > 0 and (
        max_context_len >= SPLIT_KV_ROUNDS_FROM
    )


def split_when_seen(longest_context: int, partitions: int) -> bool:
    """Whether a step whose longest context the host knows takes split-KV (with `partitions`
    from `step_partitions`): when it spans more than one partition. A speed choice: the
    single-pass kernel merges at the same partition edges and gives the same bits at any
    context (s33), so the choice never changes a request's tokens."""
    return partitions > 0 and longest_context > split_kv_partition()


def _partition_ref(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    qk_scale: float,
    dtype: torch.dtype,
    softcap_log2: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One partition's partial, 64-key step by 64-key step as `_attend_chunk_masked` runs them
    (in base 2: `qk_scale` = scale * log2(e); the row max is of the base-2 scores).

    Args:
        rows: [H_kv, M, D] float32 queries (M = Q * group rows per KV head).
        keys, values: [H_kv, N, D] float32 keys/values of the partition's live keys.
        visible: [M, N] bool: which of the partition's keys each row sees (the causal rule, or
            the tree mask over the tree region).
        dtype: the queries' dtype (the weights are rounded to it before the value product).
        softcap_log2: with a soft cap, `score_scales`' second value (`qk_scale` its first).

    Returns: (row max [H_kv, M], row sum [H_kv, M], acc [H_kv, M, D]), all float32.
    """
    num_kv_heads, num_rows, head_dim = rows.shape
    device = rows.device
    row_max = torch.full((num_kv_heads, num_rows), float("-inf"), device=device)
    row_sum = torch.zeros(num_kv_heads, num_rows, device=device)
    acc = torch.zeros(num_kv_heads, num_rows, head_dim, device=device)
    for chunk_start in range(0, keys.shape[1], DECODE_BLOCK_N):
        chunk = slice(chunk_start, chunk_start + DECODE_BLOCK_N)
        scores = (rows @ keys[:, chunk].transpose(-1, -2)) * qk_scale  # [H_kv, M, N], base 2
        if softcap_log2 is not None:
            scores = soft_cap_ref(scores, softcap_log2)
        scores = scores.masked_fill(~visible[None, :, chunk], -torch.inf)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
        weights = torch.exp2(scores - safe_max[..., None])
        rescale = torch.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + weights.sum(dim=-1)
        update = weights.to(dtype).to(torch.float32) @ values[:, chunk]
        acc = acc * rescale[..., None] + update
        row_max = new_max
    return row_max, row_sum, acc


def check_tree_window(
    meta: DecodeMetadata, sliding_window: int | None, positions: torch.Tensor | None
) -> None:
    """Raises ValueError for a tree step under a window without its rows' positions, or with a
    region wider than the window (as `fused_triton.kernel_window`)."""
    if sliding_window is None or meta.tree_mask is None:
        return
    region = meta.tree_mask.shape[-1]
    if positions is None or region > sliding_window:
        raise ValueError(
            f"a tree step under a sliding window of {sliding_window} needs its rows' positions "
            f"and a region of at most that many keys (got {region})"
        )


def window_positions_ref(
    meta: DecodeMetadata, b: int, context_len: int, query_len: int, positions: torch.Tensor | None
) -> torch.Tensor:
    """[Q] int64: the positions sequence b's rows count their window from: row j's index
    position context_len - query_len + j, or under a tree mask a live row's own position
    (`positions` [B * Q]: a node sits at its depth), as the kernels' `_window_start`."""
    device = meta.context_lens.device
    q_per_seq = meta.query_per_seq
    index = torch.arange(q_per_seq, device=device)
    query_pos = context_len - query_len + index
    if meta.tree_mask is None or positions is None:
        return query_pos
    own = positions[b * q_per_seq : (b + 1) * q_per_seq].to(device, torch.int64)
    return torch.where(index < query_len, own, query_pos)


def _visible_ref(
    meta: DecodeMetadata,
    b: int,
    context_len: int,
    query_len: int,
    sliding_window: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Q, S] bool: the keys each query token of sequence b sees: the causal rule (token j at
    position S - query_len + j), the last W keys replaced by `meta.tree_mask[b]` when given (as
    `fused.paged_decode_attention_ref`), and with a window none at or before position
    p - sliding_window (p: `window_positions_ref`'s)."""
    device = meta.context_lens.device
    q_per_seq = meta.query_per_seq
    query_pos = context_len - query_len + torch.arange(q_per_seq, device=device)
    visible = torch.arange(context_len, device=device)[None] <= query_pos[:, None]
    if meta.tree_mask is not None:
        region = meta.tree_mask[b].to(device, torch.bool)  # [Q, W] (nonzero: seen)
        prefix = context_len - region.shape[1]
        if prefix < 0:  # a context shorter than the region: its first keys do not exist
            region, prefix = region[:, -prefix:], 0
        visible[:, prefix:] = region
    if sliding_window is not None:
        key_pos = torch.arange(context_len, device=device)
        window_pos = window_positions_ref(meta, b, context_len, query_len, positions)
        visible &= key_pos[None, :] > window_pos[:, None] - sliding_window
    return visible


def combine_partials_ref(
    part_max: torch.Tensor, part_sum: torch.Tensor, part_acc: torch.Tensor
) -> torch.Tensor:
    """The second pass: partials merged in partition order (`merge_partial_ref`).

    Args:
        part_max, part_sum: [P, ...] float32 partials of P partitions (row max may be -inf).
        part_acc: [P, ..., D] float32 unnormalised outputs.

    Returns: [..., D] float32: the merged acc / max(merged sum, 1e-30).
    """
    return combine_partials_lse_ref(part_max, part_sum, part_acc)[0]


def combine_partials_lse_ref(
    part_max: torch.Tensor, part_sum: torch.Tensor, part_acc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`combine_partials_ref` and the rows' log-sum-exp of their scaled scores.

    Returns: (out [..., D] float32 as `combine_partials_ref`, lse [...] float32
    = M' ln 2 + log(l) with M' the merged max, or 0 where it is -inf: the natural log-sum-exp,
    -inf for rows that saw no key).
    """
    row_max = torch.full(part_max.shape[1:], -torch.inf, device=part_max.device)
    row_sum = torch.zeros(part_max.shape[1:], device=part_max.device)
    acc = torch.zeros(part_acc.shape[1:], device=part_acc.device)
    for p in range(part_max.shape[0]):
        row_max, row_sum, acc = merge_partial_ref(
            row_max, row_sum, acc, part_max[p], part_sum[p], part_acc[p]
        )
    safe_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    return acc / row_sum.clamp_min(1e-30)[..., None], safe_max * LN2 + torch.log(row_sum)


def split_kv_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its cached context, partition by
    partition (see the module docstring); the same contract as
    `fused.paged_decode_attention_ref` (`sliding_window`, `softcap` and `positions` too).

    Args:
        query: [B * Q, H_q, D] rotated queries in the uniform layout of `meta`.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches, already holding
            the new tokens' K/V (an FP8 cache is read as it is: scale 1.0).
        meta: the step's decode metadata (its `num_partitions` partitions must cover every
            context).
        scale: softmax scale.

    Returns:
        [B * Q, H_q, D] in query's dtype; rows of inert sequences (context 0) are 0.
    """
    out, _ = split_kv_attention_lse_ref(
        query,
        k_cache,
        v_cache,
        meta,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
        positions=positions,
    )
    return out.to(query.dtype)


def split_kv_attention_lse_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV attention with its row log-sum-exps, in float32 (to be merged with another
    partial attention of the same rows, as the block drafters' paged context is).

    Query row j of sequence b sits at position context_lens[b] - query_lens[b] + j and sees the
    cached keys up to it (as `split_kv_decode_attention_ref`): query_lens 0 lets every row see
    its whole context (no causal mask); with `meta.tree_mask` the last W keys are seen through
    the mask instead (a tree verify step). `meta.slot_mapping` is not read.

    Args:
        query: [B * Q, H_q, D] rotated queries in the uniform layout of `meta`.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches.
        meta: block tables, context and query lengths (its `num_partitions` is the kernels').
        scale: softmax scale.
        sliding_window: if set, a row at position p sees no key at or before p - sliding_window
            (under a tree mask p is the row's own position: `positions`).
        softcap: if set, soft-capped scores (`attention_tiles.score_scales`).
        positions: [B * Q] int64 rows' positions (read for a tree step under a window).

    Returns: (out [B * Q, H_q, D] float32, lse [B * Q, H_q] float32 of the scaled scores);
    rows that see no key have out 0 and lse -inf.
    """
    q_per_seq = meta.query_per_seq
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    check_tree_window(meta, sliding_window, positions)
    qk_scale, softcap_log2 = score_scales(scale, softcap)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:2], -torch.inf, device=query.device)
    query_lens = meta.query_lens.tolist()
    for b, context_len in enumerate(meta.context_lens.tolist()):
        if context_len == 0:
            continue
        blocks = meta.block_tables[b, : -(-context_len // block_size)].to(torch.int64)
        keys = k_cache[blocks].flatten(0, 1)[:context_len]  # [S, H_kv, D]
        values = v_cache[blocks].flatten(0, 1)[:context_len]
        keys = keys.to(torch.float32).to(query.dtype).to(torch.float32).transpose(0, 1)
        values = values.to(torch.float32).to(query.dtype).to(torch.float32).transpose(0, 1)
        rows = query[b * q_per_seq : (b + 1) * q_per_seq].to(torch.float32)  # [Q, H_q, D]
        # Row m of KV head h is query token m // group, q head h * group + m % group.
        rows = rows.view(q_per_seq, num_kv_heads, group, head_dim).transpose(0, 1)
        rows = rows.reshape(num_kv_heads, q_per_seq * group, head_dim)
        token = torch.arange(q_per_seq * group, device=query.device) // group
        visible = _visible_ref(meta, b, context_len, query_lens[b], sliding_window, positions)
        visible = visible[token]  # [M, S]
        size = split_kv_partition()
        partials = [
            _partition_ref(
                rows,
                keys[:, start : start + size],
                values[:, start : start + size],
                visible[:, start : start + size],
                qk_scale,
                query.dtype,
                None if softcap is None else softcap_log2,
            )
            for start in range(0, context_len, size)
        ]
        part_max, part_sum, part_acc = (torch.stack(parts) for parts in zip(*partials, strict=True))
        result, row_lse = combine_partials_lse_ref(part_max, part_sum, part_acc)  # [H_kv, M, ...]
        result = result.view(num_kv_heads, q_per_seq, group, head_dim).transpose(0, 1)
        out[b * q_per_seq : (b + 1) * q_per_seq] = result.reshape(q_per_seq, num_heads, head_dim)
        row_lse = row_lse.view(num_kv_heads, q_per_seq, group).transpose(0, 1)
        lse[b * q_per_seq : (b + 1) * q_per_seq] = row_lse.reshape(q_per_seq, num_heads)
    return out, lse


def split_kv_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `split_kv_decode_attention_ref`; two kernels per step and layer on CUDA (no host
    sync: CUDA-graph safe, the grid fixed by `meta.num_partitions`)."""
    options = dict(sliding_window=sliding_window, softcap=softcap, positions=positions)
    if not query.is_cuda:
        return split_kv_decode_attention_ref(query, k_cache, v_cache, meta, scale, **options)
    from specdec.models import split_kv_triton

    return split_kv_triton.split_kv_decode_attention_triton(
        query, k_cache, v_cache, meta, scale, **options
    )


def split_kv_attention_lse(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `split_kv_attention_lse_ref`; on CUDA the split-KV kernels over `meta.num_partitions`
    partitions a sequence (fixed: they must cover every context; CUDA-graph safe)."""
    if not query.is_cuda:
        return split_kv_attention_lse_ref(query, k_cache, v_cache, meta, scale, softcap=softcap)
    from specdec.models import split_kv_triton

    return split_kv_triton.split_kv_attention_lse_triton(
        query, k_cache, v_cache, meta, scale, softcap
    )
