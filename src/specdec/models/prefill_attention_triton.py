"""The Triton kernel behind `specdec.models.prefill_attention` (imported only for CUDA tensors, or
under Triton's CPU interpreter).

One program per (query tile of BLOCK_M tokens, sequence, query head): it walks the key tiles its
rows can see, gathering keys and values through the block table, every tile under the causal,
context (and sliding-window) masks, scores soft-capped where the layer caps them (Gemma 2), with the
decode kernels' arithmetic, so that a token's row has the same bits whichever kernel computes it
(tests/parity checks it); past one split-KV partition of keys, with the decode kernels'
partition edges and merges too. No host sync; addresses in int64 (a 128K context times heads
times head_dim passes 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.models.attention_tiles import PREFILL_BLOCK_N, kernel_partition, score_scales
from specdec.models.partition_merge_triton import merge_partial_triton
from specdec.triton_specialization import unspecialized


@triton.jit
def _prefill_tile(
    key_start,
    query,  # [BLOCK_M, BLOCK_D]
    query_pos,  # [BLOCK_M] int
    context_len,
    window,
    row_max,  # [BLOCK_M] float32, base-2 scaled scores
    row_sum,  # [BLOCK_M] float32
    acc,  # [BLOCK_M, BLOCK_D] float32
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    table_ptr,  # this sequence's row of the block table
    kv_head,
    qk_scale,
    softcap_log2,  # soft cap * log2(e) (read when SOFTCAP; `attention_tiles.score_scales`)
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys key_start .. key_start + BLOCK_N - 1 (soft-capped
    scores with SOFTCAP, as the decode kernels' `_attend_chunk_masked` caps them)."""
    dims = tl.arange(0, BLOCK_D)
    key_pos = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    live_key = key_pos < context_len
    block = tl.load(table_ptr + key_pos // CACHE_BLOCK, mask=live_key, other=0).to(tl.int64)
    slot = block * CACHE_BLOCK + key_pos % CACHE_BLOCK  # [BLOCK_N] int64
    kv_offsets = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    kv_mask = live_key[:, None] & (dims[None, :] < HEAD_DIM)
    keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if KV_FP8:
        keys = keys.to(tl.float32).to(query.dtype)
    if IEEE:
        scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
    else:
        scores = tl.dot(query, tl.trans(keys))  # [BLOCK_M, BLOCK_N] float32
    scores = scores * qk_scale
    if SOFTCAP:  # cap * tanh(scale * q.k / cap), in base 2
        scores = (1.0 - 2.0 / (tl.math.exp2(scores) + 1.0)) * softcap_log2
    if MASKED:
        visible = live_key[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if SLIDING:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # Rows that see no key yet keep -inf; shift them by 0 so exp2 gives 0, not NaN.
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.math.exp2(scores - safe_max[:, None])
    rescale = tl.math.exp2(row_max - safe_max)
    row_sum = row_sum * rescale + tl.sum(weights, axis=1)
    values = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if KV_FP8:
        values = values.to(tl.float32).to(query.dtype)
    if IEEE:
        update = tl.dot(weights.to(values.dtype), values, input_precision="ieee")
    else:
        update = tl.dot(weights.to(values.dtype), values)
    return new_max, row_sum, acc * rescale[:, None] + update


@triton.jit(
    **unspecialized(
        ints=("block_table_stride",),
        pointers=("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr"),
    )
)
def _paged_prefill_attention_kernel(
    query_ptr,  # [T, H_q, D]
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    block_tables_ptr,  # [B, max_blocks] int
    cu_seqlens_q_ptr,  # [B + 1] int
    context_lens_ptr,  # [B] int
    out_ptr,  # [T, H_q, D]
    block_table_stride,
    qk_scale,
    window,
    softcap_log2,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    DEVICE_BOUND: tl.constexpr,
    HOST_NUM_TILES: tl.constexpr,
    PARTITION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int64) - q_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
    live_row = rows < q_len
    query_pos = context_len - q_len + rows
    dims = tl.arange(0, BLOCK_D)
    offsets = ((q_start + rows)[:, None] * NUM_HEADS + head) * HEAD_DIM + dims[None, :]
    io_mask = live_row[:, None] & (dims[None, :] < HEAD_DIM)
    query = tl.load(query_ptr + offsets, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table_ptr = block_tables_ptr + seq * block_table_stride
    # Keys this tile's live rows see: [lo, hi); a tile without live rows walks nothing.
    num_live = tl.minimum(tl.maximum(q_len - q_tile * BLOCK_M, 0), BLOCK_M)
    first_pos = context_len - q_len + q_tile * BLOCK_M
    hi = tl.where(num_live > 0, first_pos + num_live, 0)
    if SLIDING:  # noqa: SIM108 (a constexpr branch)
        lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        lo = hi * 0
    # Every tile masked, as the decode kernels' steps are (`_attend_chunk_masked`): an unmasked
    # tile lets the compiler fuse the scale into the exponent's subtraction, and a token's row
    # would then differ in its last bits from the row decode computes for it.
    if PARTITION == 0:  # every context within one partition (the launcher's rule)
        if DEVICE_BOUND:
            for key_start in range(lo, hi, BLOCK_N):
                row_max, row_sum, acc = _prefill_tile(
                    key_start, query, query_pos, context_len, window, row_max, row_sum, acc,
                    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale, softcap_log2,
                    NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D,
                    True, SLIDING, KV_FP8, IEEE, SOFTCAP,
                )  # fmt: skip
        else:  # Triton's CPU interpreter cannot loop to a loaded bound: every tile, masked
            for tile in range(0, HOST_NUM_TILES):
                row_max, row_sum, acc = _prefill_tile(
                    tile * BLOCK_N, query, query_pos, hi, window, row_max, row_sum, acc,
                    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale, softcap_log2,
                    NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D,
                    True, SLIDING, KV_FP8, IEEE, SOFTCAP,
                )  # fmt: skip
    else:
        # The split-KV partitions' edges, each partition from an empty state, merged in order
        # (`partition_merge_triton`): the decode kernels' bits at any context length.
        tiles_per_part: tl.constexpr = PARTITION // BLOCK_N
        merged_max, merged_sum, merged_acc = row_max, row_sum, acc
        if DEVICE_BOUND:
            for part in range(lo // PARTITION, tl.cdiv(hi, PARTITION)):
                row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                row_sum = tl.zeros((BLOCK_M,), tl.float32)
                acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
                first = tl.maximum(part * PARTITION, lo)
                for key_start in range(first, tl.minimum((part + 1) * PARTITION, hi), BLOCK_N):
                    row_max, row_sum, acc = _prefill_tile(
                        key_start, query, query_pos, context_len, window, row_max, row_sum,
                        acc, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                        softcap_log2, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D,
                        True, SLIDING, KV_FP8, IEEE, SOFTCAP,
                    )  # fmt: skip
                merged_max, merged_sum, merged_acc = merge_partial_triton(
                    merged_max, merged_sum, merged_acc, row_max, row_sum, acc
                )
        else:  # the interpreter: every partition of the table, masks void the extra tiles
            for part in range(0, tl.cdiv(HOST_NUM_TILES, tiles_per_part)):
                row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                row_sum = tl.zeros((BLOCK_M,), tl.float32)
                acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
                for step in range(0, tiles_per_part):
                    row_max, row_sum, acc = _prefill_tile(
                        (part * tiles_per_part + step) * BLOCK_N, query, query_pos, hi, window,
                        row_max, row_sum, acc, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                        qk_scale, softcap_log2, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N,
                        BLOCK_D, True, SLIDING, KV_FP8, IEEE, SOFTCAP,
                    )  # fmt: skip
                merged_max, merged_sum, merged_acc = merge_partial_triton(
                    merged_max, merged_sum, merged_acc, row_max, row_sum, acc
                )
        row_sum, acc = merged_sum, merged_acc
    out = acc / tl.maximum(row_sum, 1e-30)[:, None]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_tile(dtype: torch.dtype, block_d: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) of the prefill kernel for queries of `dtype`.

    32 query rows and 4 warps, as the decode kernels' tiles: on the H200 at head_dim 128 the
    wider tiles (64 or 128 rows) gave 3 of 93 rows other bits than the decode kernel (the
    online softmax's row sums lay out differently), 32 and 16 rows none; at head_dim 64 every
    tile matched, and 32 rows was as fast as 128 (0.039 against 0.042 ms for 1,200 tokens;
    the 8B shape: 0.125 against 0.085 ms, `probe_batch_invariance.py --parts prefill-tiles`)."""
    if dtype == torch.float32:
        return 32, 4, 1
    return 32, 4, 3 if block_d <= 128 else 2


def paged_prefill_attention_triton(
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
    num_tokens, num_heads, head_dim = query.shape
    _, cache_block, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, num_warps, num_stages = prefill_tile(query.dtype, block_d)
    host_tiles = 0
    if not query.is_cuda:  # the interpreter's bound: every key tile of the longest context
        host_tiles = triton.cdiv(int(context_lens.max()), PREFILL_BLOCK_N)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    qk_scale, softcap_log2 = score_scales(scale, softcap)
    _paged_prefill_attention_kernel[grid](
        query.contiguous(),
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        block_tables.stride(0),
        qk_scale,
        sliding_window or 0,
        softcap_log2,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        CACHE_BLOCK=cache_block,
        BLOCK_M=block_m,
        BLOCK_N=PREFILL_BLOCK_N,
        BLOCK_D=block_d,
        SLIDING=sliding_window is not None,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        IEEE=query.dtype == torch.float32,
        DEVICE_BOUND=query.is_cuda,
        HOST_NUM_TILES=host_tiles,
        PARTITION=kernel_partition(block_tables.shape[1] * cache_block),
        SOFTCAP=softcap is not None,
        enable_fp_fusion=False,  # see attention_tiles.NO_FP_FUSION
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
