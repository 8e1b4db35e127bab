"""The Triton kernels behind `specdec.models.split_kv` (imported only for CUDA tensors, or under
Triton's CPU interpreter).

Pass 1: one program per (sequence, KV head and row tile, partition) runs the single-pass
decode kernel's 64-key steps (`fused_triton._attend_chunk_masked`, under the tree mask when there
is one) over its partition and writes the partial (row max of the base-2 scores, row sum,
unnormalised output) of its BLOCK_M rows (query token x q head of the group); a program whose
partition starts past its sequence's context reads and writes nothing, and one wholly before its
rows' sliding window (SLIDING) walks no key: its partial is the empty one (row max -inf, sum 0),
which the merge leaves out. Pass 2: one program per (sequence, KV head and row tile) merges the
live partitions one at a time in order (`partition_merge_triton`, as the single-pass and prefill
kernels merge at their partition edges) and, with WRITE_LSE, writes each row's natural
log-sum-exp. No host sync (CUDA-graph safe); addresses in int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.models.attention import DecodeMetadata
from specdec.models.attention_tiles import (
    DECODE_BLOCK_N,
    LN2,
    decode_block_m,
    decode_row_tiles,
    score_scales,
    split_kv_partition,
)
from specdec.models.fused_triton import (
    _attend_chunk_masked,
    _window_start,
    kernel_tree_mask,
    kernel_window,
)
from specdec.models.partition_merge_triton import merge_partial_triton
from specdec.triton_specialization import unspecialized

# A kernel reads a module global only as a constexpr (Triton 3.6 refuses a plain float on the
# GPU; the CPU interpreter takes either, so only the H200 run of the LSE path showed it, s22).
_LN2 = tl.constexpr(LN2)


@triton.jit(
    **unspecialized(
        ints=("block_table_stride", "tree_seq_stride", "tree_row_stride", "tree_width"),
        pointers=(
            "block_tables_ptr",
            "context_lens_ptr",
            "query_lens_ptr",
            "tree_mask_ptr",
            "positions_ptr",
        ),
    )
)
def _split_kv_partition_kernel(
    query_ptr,  # [B * Q, H_q, D]
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    block_tables_ptr,  # [B, max_blocks] int
    context_lens_ptr,  # [B] int
    query_lens_ptr,  # [B] int
    part_max_ptr,  # [B, H_kv * ROW_TILES, P, BLOCK_M] float32
    part_sum_ptr,  # [B, H_kv * ROW_TILES, P, BLOCK_M] float32
    part_acc_ptr,  # [B, H_kv * ROW_TILES, P, BLOCK_M, BLOCK_D] float32
    tree_mask_ptr,  # [B, Q, W] int8 tree region (read when TREE; nonzero: visible)
    positions_ptr,  # [B * Q] int64 rows' positions (read when TREE and SLIDING)
    block_table_stride,
    tree_seq_stride,
    tree_row_stride,
    tree_width,  # W
    qk_scale,  # softmax scale * log2(e) (with SOFTCAP: `score_scales`' capped form)
    window,  # sliding window in keys (read when SLIDING)
    softcap_log2,  # soft cap * log2(e) (read when SOFTCAP)
    Q_PER_SEQ: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    DEVICE_BOUND: tl.constexpr,
    TREE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // ROW_TILES
    part = tl.program_id(2).to(tl.int64)
    num_heads: tl.constexpr = GROUP * NUM_KV_HEADS
    chunks_per_part: tl.constexpr = PARTITION // BLOCK_N
    # Row m of the group's rows is query token m // GROUP, q head kv_head * GROUP + m % GROUP;
    # this program takes rows tile * BLOCK_M + local (the single-pass kernel's tiles).
    local = tl.arange(0, BLOCK_M)
    rows = (tl.program_id(1) % ROW_TILES) * BLOCK_M + local
    token_in_seq = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    live_row = token_in_seq < Q_PER_SEQ
    dims = tl.arange(0, BLOCK_D)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
    query_len = tl.load(query_lens_ptr + seq).to(tl.int64)
    live_part = part * PARTITION < context_len
    query_rows = (seq * Q_PER_SEQ + token_in_seq) * num_heads + head  # [BLOCK_M] int64
    query = tl.load(
        query_ptr + query_rows[:, None] * HEAD_DIM + dims[None, :],
        mask=live_part & live_row[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    query_pos = context_len - query_len + token_in_seq  # [BLOCK_M]
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table_ptr = block_tables_ptr + seq * block_table_stride
    # The tree region (TREE only): row m reads mask row [seq, m // GROUP] over the last W keys,
    # as the single-pass kernel does.
    tree_rows_ptr = tree_mask_ptr + seq * tree_seq_stride + token_in_seq * tree_row_stride
    region_start = context_len - tree_width
    first_chunk = part * chunks_per_part
    if SLIDING:  # chunks before every row's window: identity steps (see `_window_start`)
        window_pos, window_chunk = _window_start(
            positions_ptr, seq, token_in_seq, query_pos, query_len, live_row, region_start,
            context_len - query_len, window, Q_PER_SEQ, BLOCK_N, TREE,
        )  # fmt: skip
        start_chunk = tl.maximum(first_chunk, window_chunk)
    else:
        window_pos, start_chunk = query_pos, first_chunk
    if DEVICE_BOUND:
        last_chunk = tl.minimum(first_chunk + chunks_per_part, tl.cdiv(context_len, BLOCK_N))
        for chunk in range(start_chunk, last_chunk):
            row_max, row_sum, acc = _attend_chunk_masked(
                chunk, query, query_pos, context_len, row_max, row_sum, acc,
                k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                tree_rows_ptr, region_start, live_row, window_pos, window, softcap_log2,
                NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D, IEEE, KV_FP8, TREE,
                SLIDING, SOFTCAP,
            )  # fmt: skip
    else:  # Triton's CPU interpreter cannot loop to a loaded bound; masks void extra chunks
        for step in range(0, chunks_per_part):
            row_max, row_sum, acc = _attend_chunk_masked(
                first_chunk + step, query, query_pos, context_len, row_max, row_sum, acc,
                k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                tree_rows_ptr, region_start, live_row, window_pos, window, softcap_log2,
                NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D, IEEE, KV_FP8, TREE,
                SLIDING, SOFTCAP,
            )  # fmt: skip
    program = seq * NUM_KV_HEADS * ROW_TILES + tl.program_id(1)
    partial = (program * NUM_PARTITIONS + part) * BLOCK_M + local
    tl.store(part_max_ptr + partial, row_max, mask=live_part & (local < BLOCK_M))
    tl.store(part_sum_ptr + partial, row_sum, mask=live_part & (local < BLOCK_M))
    tl.store(
        part_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :],
        acc,
        mask=live_part & (local[:, None] < BLOCK_M) & (dims[None, :] < BLOCK_D),
    )


@triton.jit
def _merge_loaded(
    p,
    num_parts,
    row_max,  # [BLOCK_M] float32
    total,  # [BLOCK_M] float32
    acc,  # [BLOCK_M, BLOCK_D] float32
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    base,
    rows,
    dims,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merges partition p's partial into the running state (nothing when p >= num_parts: an
    empty partial leaves it as it is)."""
    inside = (rows < BLOCK_M) & (p < num_parts)
    offsets = (base + p) * BLOCK_M + rows
    part_max = tl.load(part_max_ptr + offsets, mask=inside, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + offsets, mask=inside, other=0.0)
    part_acc = tl.load(
        part_acc_ptr + offsets[:, None] * BLOCK_D + dims[None, :],
        mask=inside[:, None] & (dims[None, :] < BLOCK_D),
        other=0.0,
    )
    return merge_partial_triton(row_max, total, acc, part_max, part_sum, part_acc)


@triton.jit
def _split_kv_reduce_kernel(
    part_max_ptr,  # [B, H_kv * ROW_TILES, P, BLOCK_M] float32
    part_sum_ptr,  # [B, H_kv * ROW_TILES, P, BLOCK_M] float32
    part_acc_ptr,  # [B, H_kv * ROW_TILES, P, BLOCK_M, BLOCK_D] float32
    context_lens_ptr,  # [B] int
    out_ptr,  # [B * Q, H_q, D]
    lse_ptr,  # [B * Q, H_q] float32 (read only with WRITE_LSE)
    Q_PER_SEQ: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_TILES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
    DEVICE_BOUND: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // ROW_TILES
    num_heads: tl.constexpr = GROUP * NUM_KV_HEADS
    local = tl.arange(0, BLOCK_M)
    rows = (tl.program_id(1) % ROW_TILES) * BLOCK_M + local
    token_in_seq = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    live_row = token_in_seq < Q_PER_SEQ
    dims = tl.arange(0, BLOCK_D)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
    num_parts = tl.minimum(tl.cdiv(context_len, PARTITION), NUM_PARTITIONS)
    base = (seq * NUM_KV_HEADS * ROW_TILES + tl.program_id(1)) * NUM_PARTITIONS
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if DEVICE_BOUND:
        for p in range(0, num_parts):
            row_max, total, acc = _merge_loaded(
                p, num_parts, row_max, total, acc, part_max_ptr, part_sum_ptr, part_acc_ptr,
                base, local, dims, BLOCK_M, BLOCK_D,
            )  # fmt: skip
    else:
        for p in range(0, NUM_PARTITIONS):
            row_max, total, acc = _merge_loaded(
                p, num_parts, row_max, total, acc, part_max_ptr, part_sum_ptr, part_acc_ptr,
                base, local, dims, BLOCK_M, BLOCK_D,
            )  # fmt: skip
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    out = acc / tl.maximum(total, 1e-30)[:, None]
    query_rows = (seq * Q_PER_SEQ + token_in_seq) * num_heads + head  # [BLOCK_M] int64
    tl.store(
        out_ptr + query_rows[:, None] * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live_row[:, None] & (dims[None, :] < HEAD_DIM),
    )
    if WRITE_LSE:  # natural log; log(0) = -inf for rows that saw no key
        tl.store(lse_ptr + query_rows, safe_max * _LN2 + tl.log(total), mask=live_row)


@dataclass(frozen=True, slots=True)
class SplitKVTiles:
    """The launch shape of the first pass: keys per partition and per online-softmax step,
    warps, and software-pipeline stages (None: Triton's default)."""

    partition: int
    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int | None = None


def default_tiles() -> SplitKVTiles:
    """The tiles the twin follows (read at each launch: tests shrink the partition)."""
    return SplitKVTiles(split_kv_partition(), DECODE_BLOCK_N)


def split_kv_decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    tiles: SplitKVTiles | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-KV attention of `query` (with `meta.num_partitions` partitions of
    `tiles.partition` keys); tiles other than the default are for the tuning probe."""
    out = torch.empty_like(query)
    _launch(
        query, k_cache, v_cache, meta, scale, out, None, tiles, sliding_window, softcap, positions
    )
    return out


def split_kv_attention_lse_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_kv.split_kv_attention_lse_ref` on the kernels: (out float32, lse float32)."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:2], -torch.inf, device=query.device)
    _launch(query, k_cache, v_cache, meta, scale, out, lse, softcap=softcap)
    return out, lse


def _launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    tiles: SplitKVTiles | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Both passes, writing `out` [B * Q, H_q, D] (and `lse` [B * Q, H_q] float32 if given);
    `tiles` other than the default only for the tuning probe (the twin follows the default);
    `sliding_window` / `softcap` / `positions` as `split_kv.split_kv_attention_lse_ref`'s."""
    tiles = tiles or default_tiles()
    num_seqs = meta.context_lens.shape[0]
    num_parts, query_per_seq = meta.num_partitions, meta.query_per_seq
    _, num_heads, head_dim = query.shape
    _, cache_block, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 0 or num_parts == 0:
        return
    # The tile shapes of the single-pass kernel (`fused_triton`), so that a one-partition
    # context gives its bits.
    block_m = decode_block_m(query_per_seq, group)
    row_tiles = decode_row_tiles(query_per_seq, group)
    programs = num_kv_heads * row_tiles  # per sequence
    block_d = max(16, triton.next_power_of_2(head_dim))
    device = query.device
    part_max = torch.empty(num_seqs, programs, num_parts, block_m, device=device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(num_seqs, programs, num_parts, block_m, block_d, device=device)
    common = dict(
        Q_PER_SEQ=query_per_seq,
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        ROW_TILES=row_tiles,
        BLOCK_D=block_d,
        PARTITION=tiles.partition,
        NUM_PARTITIONS=num_parts,
        DEVICE_BOUND=query.is_cuda,
    )
    tree = kernel_tree_mask(meta)
    window, tree_positions = kernel_window(meta, sliding_window, positions)
    qk_scale, softcap_log2 = score_scales(scale, softcap)
    _split_kv_partition_kernel[(num_seqs, programs, num_parts)](
        query.contiguous(),
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        meta.query_lens,
        part_max,
        part_sum,
        part_acc,
        meta.context_lens if tree is None else tree,
        meta.context_lens if tree_positions is None else tree_positions,
        meta.block_tables.stride(0),
        0 if tree is None else tree.stride(0),
        0 if tree is None else tree.stride(1),
        0 if tree is None else tree.shape[2],
        qk_scale,
        window,
        softcap_log2,
        CACHE_BLOCK=cache_block,
        BLOCK_N=tiles.block_n,
        IEEE=query.dtype == torch.float32,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        TREE=tree is not None,
        SLIDING=window > 0,
        SOFTCAP=softcap is not None,
        enable_fp_fusion=False,  # see attention_tiles.NO_FP_FUSION
        num_warps=tiles.num_warps,
        **({} if tiles.num_stages is None else {"num_stages": tiles.num_stages}),
        **common,
    )
    _split_kv_reduce_kernel[(num_seqs, programs)](
        part_max,
        part_sum,
        part_acc,
        meta.context_lens,
        out,
        out if lse is None else lse,
        WRITE_LSE=lse is not None,
        enable_fp_fusion=False,
        num_warps=4,
        **common,
    )
