"""Triton kernels behind `specdec.models.fused` (imported only for CUDA tensors).

Each launcher takes exactly the arguments of its `*_ref` twin in `fused.py`. None of them syncs
with the host, so a decode step made of them and cuBLAS GEMMs can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.models.attention import DecodeMetadata
from specdec.models.attention_tiles import (
    DECODE_BLOCK_N,
    decode_block_m,
    decode_row_tiles,
    kernel_partition,
    score_scales,
)
from specdec.models.partition_merge_triton import merge_partial_triton
from specdec.triton_specialization import unspecialized

# The decode kernel's per-step metadata (see `specdec.triton_specialization`).
_DECODE_METADATA = unspecialized(
    ints=("block_table_stride", "tree_seq_stride", "tree_row_stride", "tree_width"),
    pointers=(
        "block_tables_ptr",
        "context_lens_ptr",
        "query_lens_ptr",
        "tree_mask_ptr",
        "positions_ptr",
    ),
)


@triton.jit
def _fp8_saturate(x):
    """float32 `x` clamped to float8 e4m3's finite range (+-448), as `attention.to_cache_dtype`."""
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


@triton.jit(**unspecialized(pointers=("positions_ptr", "slot_mapping_ptr")))
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (H_q + 2 H_kv) * D]
    positions_ptr,  # [T] int64
    inv_freq_ptr,  # [D / 2] float32, or [T, D / 2] (PER_ROW_FREQ)
    query_ptr,  # [T, H_q, D] out
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    slot_mapping_ptr,  # [T] int64
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    KV_FP8: tl.constexpr,
    PER_ROW_FREQ: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    head_dim: tl.constexpr = 2 * HALF_DIM
    row_width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * head_dim
    cols = tl.arange(0, BLOCK_HALF)
    inside = cols < HALF_DIM
    position = tl.load(positions_ptr + token).to(tl.float32)
    if PER_ROW_FREQ:  # each token its own table (longrope: short or long factors by position)
        inv_freq_ptr += token * HALF_DIM
    freqs = position * tl.load(inv_freq_ptr + cols, mask=inside, other=0.0)
    cos, sin = tl.cos(freqs), tl.sin(freqs)
    src = qkv_ptr + token * row_width + head * head_dim
    first = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
    second = tl.load(src + HALF_DIM + cols, mask=inside, other=0.0).to(tl.float32)
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    if head < NUM_HEADS:
        dst = query_ptr + (token * NUM_HEADS + head) * head_dim
        tl.store(dst + cols, rotated_first.to(query_ptr.dtype.element_ty), mask=inside)
        tl.store(dst + HALF_DIM + cols, rotated_second.to(query_ptr.dtype.element_ty), mask=inside)
    else:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            dst = (slot * NUM_KV_HEADS + kv_head) * head_dim
            key_type = k_cache_ptr.dtype.element_ty
            value_src = src + NUM_KV_HEADS * head_dim
            value_type = v_cache_ptr.dtype.element_ty
            value_first = tl.load(value_src + cols, mask=inside)
            value_second = tl.load(value_src + HALF_DIM + cols, mask=inside)
            if KV_FP8:
                # As the twin: the key in the activation dtype, then saturated and rounded to
                # the nearest float8 (one rounding from the activation value).
                act_type = query_ptr.dtype.element_ty
                key_first = _fp8_saturate(rotated_first.to(act_type).to(tl.float32))
                key_second = _fp8_saturate(rotated_second.to(act_type).to(tl.float32))
                key_first = key_first.to(key_type, fp_downcast_rounding="rtne")
                key_second = key_second.to(key_type, fp_downcast_rounding="rtne")
                value_first = _fp8_saturate(value_first.to(tl.float32))
                value_second = _fp8_saturate(value_second.to(tl.float32))
                value_first = value_first.to(value_type, fp_downcast_rounding="rtne")
                value_second = value_second.to(value_type, fp_downcast_rounding="rtne")
            else:
                key_first, key_second = rotated_first.to(key_type), rotated_second.to(key_type)
                value_first, value_second = value_first.to(value_type), value_second.to(value_type)
            tl.store(k_cache_ptr + dst + cols, key_first, mask=inside)
            tl.store(k_cache_ptr + dst + HALF_DIM + cols, key_second, mask=inside)
            tl.store(v_cache_ptr + dst + cols, value_first, mask=inside)
            tl.store(v_cache_ptr + dst + HALF_DIM + cols, value_second, mask=inside)


def rope_write_kv_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    query = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    per_row = inv_freq.dim() == 2
    if per_row and inv_freq.shape != (num_tokens, head_dim // 2):
        raise ValueError(
            f"per-token inverse frequencies of shape {tuple(inv_freq.shape)}, expected "
            f"({num_tokens}, {head_dim // 2})"
        )
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv.contiguous(),
            positions,
            inv_freq.to(torch.float32).contiguous(),
            query,
            k_cache,
            v_cache,
            slot_mapping,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HALF_DIM=head_dim // 2,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
            PER_ROW_FREQ=per_row,
            num_warps=1,
        )
    return query


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2F]
    out_ptr,  # [T, F]
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0)
    gate32 = gate.to(tl.float32)
    # Round silu(gate) to the dtype before the product, as eager `F.silu(gate) * up` does.
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * width + cols, out, mask=inside)


def _gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] (gate | up) -> [T, F] through an activation-times-up kernel (`_silu_mul_kernel`,
    `_gelu_tanh_mul_kernel`): one program per (row, block of columns)."""
    num_tokens, double_width = gate_up.shape
    width = double_width // 2
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = 1024
        kernel[(num_tokens, triton.cdiv(width, block))](
            gate_up.contiguous(), out, width, BLOCK=block, num_warps=4
        )
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(_silu_mul_kernel, gate_up)


# GELU's tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
_GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh_mul_kernel(
    gate_up_ptr,  # [T, 2F]
    out_ptr,  # [T, F]
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0)
    gate32 = gate.to(tl.float32)
    inner = _GELU_BETA * (gate32 + _GELU_KAPPA * gate32 * gate32 * gate32)
    # 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)): no cancellation for negative x (-> -0, never
    # NaN). Rounded to the dtype before the product, as eager `F.gelu(gate) * up` does.
    activated = (gate32 / (1.0 + tl.exp(-2.0 * inner))).to(gate.dtype)
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * width + cols, out, mask=inside)


def gelu_tanh_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(_gelu_tanh_mul_kernel, gate_up)


@triton.jit
def _attend_chunk_masked(
    chunk,
    query,  # [BLOCK_M, D]
    query_pos,  # [BLOCK_M]
    context_len,
    row_max,  # [BLOCK_M] float32
    row_sum,  # [BLOCK_M] float32
    acc,  # [BLOCK_M, D] float32
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_head,
    qk_scale,
    tree_rows_ptr,  # [BLOCK_M] pointers to each row's tree-mask row (read when TREE)
    region_start,  # context_len - W: the first key of the tree region (may be < 0)
    live_tree_row,  # [BLOCK_M] bool or 0: rows whose tree-mask row exists (read when TREE)
    window_pos,  # [BLOCK_M] the positions the window counts from (read when SLIDING)
    window,  # the sliding window in keys (read when SLIDING)
    softcap_log2,  # the soft cap * log2(e) (read when SOFTCAP; see `score_scales`)
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    TREE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys chunk * BLOCK_N .. + BLOCK_N - 1 under the causal rule
    (shared with the split-KV kernel, whose partitions run exactly these steps), in base 2 with
    `qk_scale` = scale * log2(e): the prefill kernel's step (`_prefill_tile`) to the operation,
    so a token's row is the same bits whichever of the kernels computes it; with TREE,
    keys at or after `region_start` are seen by the tree mask (row m sees region key j iff
    tree_rows_ptr[m][j] != 0) instead of the causal rule, as `fused.paged_decode_attention_ref`
    applies `DecodeMetadata.tree_mask`; with SLIDING a row at position p = window_pos[m] sees no
    key at or before p - window (the prefill kernel's rule); with SOFTCAP the scores are soft-capped
    after the scale and before the masks (`attention_tiles.score_scales`: `qk_scale` is then
    the capped form's)."""
    dims = tl.arange(0, BLOCK_D)
    key_pos = chunk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    live_key = key_pos < context_len
    block = tl.load(block_table_ptr + key_pos // CACHE_BLOCK, mask=live_key, other=0).to(tl.int64)
    slot = block * CACHE_BLOCK + key_pos % CACHE_BLOCK  # [BLOCK_N]
    kv_offsets = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    kv_mask = live_key[:, None] & (dims[None, :] < HEAD_DIM)
    keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if KV_FP8:  # an FP8 cache is read as it is (scale 1.0), in the queries' dtype
        keys = keys.to(tl.float32).to(query.dtype)
    if IEEE:
        scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
    else:
        scores = tl.dot(query, tl.trans(keys))  # [BLOCK_M, BLOCK_N] float32
    scores = scores * qk_scale
    if SOFTCAP:  # cap * tanh(scale * q.k / cap), in base 2
        scores = (1.0 - 2.0 / (tl.math.exp2(scores) + 1.0)) * softcap_log2
    causal = key_pos[None, :] <= query_pos[:, None]  # [BLOCK_M, BLOCK_N]
    if TREE:
        in_region = key_pos >= region_start  # [BLOCK_N]
        column = key_pos - region_start
        read = live_tree_row[:, None] & (live_key & in_region)[None, :]
        bits = tl.load(tree_rows_ptr[:, None] + column[None, :], mask=read, other=0)
        causal = tl.where(in_region[None, :], bits != 0, causal)
    visible = live_key[None, :] & causal
    if SLIDING:
        visible = visible & (key_pos[None, :] > window_pos[:, None] - window)
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


@triton.jit
def _window_start(
    positions_ptr,
    seq,
    token_in_seq,  # [BLOCK_M]
    query_pos,  # [BLOCK_M] the rows' positions by their index in the step
    query_len,
    live_row,  # [BLOCK_M]
    region_start,  # context_len - W (TREE)
    first_pos,  # context_len - query_len: the first row's index position
    window,
    Q_PER_SEQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TREE: tl.constexpr,
):
    """(the position each row's window counts from [BLOCK_M], the first BLOCK_N-key chunk any
    row sees) of a windowed decode step: a row's index position, or under a tree mask a live
    row's own position (`positions_ptr`: a node sits at its depth; padding rows keep their
    index). Chunks before every row's window are identity steps (every score -inf): skipped.
    A tree's live rows sit at or after its region's start."""
    if TREE:
        live = live_row & (token_in_seq < query_len)
        own = tl.load(positions_ptr + seq * Q_PER_SEQ + token_in_seq, mask=live, other=0)
        window_pos = tl.where(live, own, query_pos)
        lowest = region_start
    else:
        window_pos = query_pos
        lowest = first_pos
    return window_pos, tl.maximum(lowest - window + 1, 0) // BLOCK_N


@triton.jit(**_DECODE_METADATA)
def _paged_decode_attention_kernel(
    query_ptr,  # [B * Q, H_q, D]
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    query_lens_ptr,  # [B] int32
    out_ptr,  # [B * Q, H_q, D]
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
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    DEVICE_BOUND: tl.constexpr,
    HOST_NUM_CHUNKS: tl.constexpr,
    PARTITION: tl.constexpr,
    TREE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // ROW_TILES
    num_heads: tl.constexpr = GROUP * NUM_KV_HEADS
    # Row m of the group's rows is query token m // GROUP, q head kv_head * GROUP + m % GROUP;
    # this program takes rows tile * BLOCK_M .. + BLOCK_M - 1.
    rows = (tl.program_id(1) % ROW_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    token_in_seq = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    live_row = token_in_seq < Q_PER_SEQ
    dims = tl.arange(0, BLOCK_D)
    query_rows = (seq * Q_PER_SEQ + token_in_seq) * num_heads + head  # [BLOCK_M]
    query = tl.load(
        query_ptr + query_rows[:, None] * HEAD_DIM + dims[None, :],
        mask=live_row[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    context_len = tl.load(context_lens_ptr + seq)
    query_len = tl.load(query_lens_ptr + seq)
    query_pos = context_len - query_len + token_in_seq  # [BLOCK_M]
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # The tree region (TREE only): row m reads mask row [seq, m // GROUP] over the last W keys.
    tree_rows_ptr = tree_mask_ptr + seq * tree_seq_stride + token_in_seq * tree_row_stride
    region_start = context_len - tree_width
    if SLIDING:
        window_pos, first_chunk = _window_start(
            positions_ptr, seq, token_in_seq, query_pos, query_len, live_row, region_start,
            context_len - query_len, window, Q_PER_SEQ, BLOCK_N, TREE,
        )  # fmt: skip
    else:
        window_pos, first_chunk = query_pos, 0
    table_ptr = block_tables_ptr + seq * block_table_stride
    if PARTITION == 0:  # every context within one partition (the launcher's rule)
        if DEVICE_BOUND:
            for chunk in range(first_chunk, tl.cdiv(context_len, BLOCK_N)):
                row_max, row_sum, acc = _attend_chunk_masked(
                    chunk, query, query_pos, context_len, row_max, row_sum, acc,
                    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                    tree_rows_ptr, region_start, live_row, window_pos, window, softcap_log2,
                    NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D, IEEE, KV_FP8, TREE,
                    SLIDING, SOFTCAP,
                )  # fmt: skip
        else:  # Triton's CPU interpreter cannot loop to a loaded bound; masks void extra chunks
            for chunk in range(0, HOST_NUM_CHUNKS):
                row_max, row_sum, acc = _attend_chunk_masked(
                    chunk, query, query_pos, context_len, row_max, row_sum, acc,
                    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                    tree_rows_ptr, region_start, live_row, window_pos, window, softcap_log2,
                    NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D, IEEE, KV_FP8, TREE,
                    SLIDING, SOFTCAP,
                )  # fmt: skip
    else:
        # Partitions of PARTITION keys at the split-KV kernel's edges, each run from an empty
        # state and merged in order as its second pass merges them: the split-KV bits at any
        # context length, whichever kernel a step takes.
        chunks_per_part: tl.constexpr = PARTITION // BLOCK_N
        num_chunks = tl.cdiv(context_len, BLOCK_N)
        merged_max, merged_sum, merged_acc = row_max, row_sum, acc
        if DEVICE_BOUND:
            for part in range(first_chunk // chunks_per_part, tl.cdiv(num_chunks, chunks_per_part)):
                row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                row_sum = tl.zeros((BLOCK_M,), tl.float32)
                acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
                lo = part * chunks_per_part
                if SLIDING:  # chunks before every row's window: identity steps, skipped
                    lo = tl.maximum(lo, first_chunk)
                for chunk in range(lo, tl.minimum((part + 1) * chunks_per_part, num_chunks)):
                    row_max, row_sum, acc = _attend_chunk_masked(
                        chunk, query, query_pos, context_len, row_max, row_sum, acc,
                        k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                        tree_rows_ptr, region_start, live_row, window_pos, window,
                        softcap_log2, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D,
                        IEEE, KV_FP8, TREE, SLIDING, SOFTCAP,
                    )  # fmt: skip
                merged_max, merged_sum, merged_acc = merge_partial_triton(
                    merged_max, merged_sum, merged_acc, row_max, row_sum, acc
                )
        else:  # the interpreter: every partition of the table, masks void the extra chunks
            for part in range(0, tl.cdiv(HOST_NUM_CHUNKS, chunks_per_part)):
                row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                row_sum = tl.zeros((BLOCK_M,), tl.float32)
                acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
                for step in range(0, chunks_per_part):
                    row_max, row_sum, acc = _attend_chunk_masked(
                        part * chunks_per_part + step, query, query_pos, context_len, row_max,
                        row_sum, acc, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, qk_scale,
                        tree_rows_ptr, region_start, live_row, window_pos, window,
                        softcap_log2, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, BLOCK_N, BLOCK_D,
                        IEEE, KV_FP8, TREE, SLIDING, SOFTCAP,
                    )  # fmt: skip
                merged_max, merged_sum, merged_acc = merge_partial_triton(
                    merged_max, merged_sum, merged_acc, row_max, row_sum, acc
                )
        row_sum, acc = merged_sum, merged_acc
    out = acc / tl.maximum(row_sum, 1e-30)[:, None]
    tl.store(
        out_ptr + query_rows[:, None] * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live_row[:, None] & (dims[None, :] < HEAD_DIM),
    )


def kernel_tree_mask(meta: DecodeMetadata) -> torch.Tensor | None:
    """`meta.tree_mask` as the decode kernels read it (single-pass and split-KV alike): checked
    [B, Q, W] with a contiguous last dimension, as int8 bytes (nonzero: visible)."""
    tree = meta.tree_mask
    if tree is None:
        return None
    num_seqs = meta.context_lens.shape[0]
    if tree.dim() != 3 or tree.shape[:2] != (num_seqs, meta.query_per_seq):
        raise ValueError(
            f"tree_mask must be [B={num_seqs}, Q={meta.query_per_seq}, W], got {list(tree.shape)}"
        )
    if tree.stride(2) != 1:
        raise ValueError("tree_mask's last dimension must be contiguous")
    # One mask type for the kernels (int8: the bytes of a bool mask; Triton reads no int1).
    # An int64 mask compiles another variant, and at 8 KV heads x 1 x D = 128 that variant did
    # not give the same bits (s10 GPU run): every mask is read as int8.
    if tree.dtype != torch.bool:
        tree = tree != 0
    return tree.view(torch.int8)


def kernel_window(
    meta: DecodeMetadata, sliding_window: int | None, positions: torch.Tensor | None
) -> tuple[int, torch.Tensor | None]:
    """The decode kernels' `window` argument (0: none) and the positions a tree step's rows
    count it from (None when not read). A causal row's window counts from its index position
    (context_len - query_len + j); a tree step's rows sit at their depths, so under a window
    a tree step needs `positions` ([B * Q] int64, each live row's own position, at or after
    its region's start) and a region of at most `sliding_window` keys (so no ancestor falls
    out of a node's window, as `attention.AttentionPlan.build` requires).

    Raises: ValueError: a window < 1, or a tree step under a window without positions or with
        a wider region."""
    if sliding_window is None:
        return 0, None
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if meta.tree_mask is None:
        return sliding_window, None
    region = meta.tree_mask.shape[-1]
    if positions is None or region > sliding_window:
        raise ValueError(
            f"a tree step under a sliding window of {sliding_window} needs its rows' positions "
            f"and a region of at most that many keys (got {region})"
        )
    return sliding_window, positions


def paged_decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    num_seqs = meta.context_lens.shape[0]
    _, num_heads, head_dim = query.shape
    _, cache_block, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    tree = kernel_tree_mask(meta)
    window, tree_positions = kernel_window(meta, sliding_window, positions)
    qk_scale, softcap_log2 = score_scales(scale, softcap)
    if num_seqs:
        row_tiles = decode_row_tiles(meta.query_per_seq, group)
        _paged_decode_attention_kernel[(num_seqs, num_kv_heads * row_tiles)](
            query.contiguous(),
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_lens,
            out,
            meta.context_lens if tree is None else tree,
            meta.context_lens if tree_positions is None else tree_positions,
            meta.block_tables.stride(0),
            0 if tree is None else tree.stride(0),
            0 if tree is None else tree.stride(1),
            0 if tree is None else tree.shape[2],
            qk_scale,
            window,
            softcap_log2,
            Q_PER_SEQ=meta.query_per_seq,
            GROUP=group,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            CACHE_BLOCK=cache_block,
            BLOCK_M=decode_block_m(meta.query_per_seq, group),
            ROW_TILES=row_tiles,
            BLOCK_N=DECODE_BLOCK_N,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            IEEE=query.dtype == torch.float32,
            KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
            DEVICE_BOUND=query.is_cuda,
            HOST_NUM_CHUNKS=0
            if query.is_cuda
            else triton.cdiv(int(meta.context_lens.max()), DECODE_BLOCK_N),
            PARTITION=kernel_partition(meta.block_tables.shape[1] * cache_block),
            TREE=tree is not None,
            SLIDING=window > 0,
            SOFTCAP=softcap is not None,
            enable_fp_fusion=False,  # see attention_tiles.NO_FP_FUSION
            num_warps=4,
        )
    return out
