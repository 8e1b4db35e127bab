"""The Triton kernels behind `specdec.engine.round_bookkeeping`: one program per slot each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.engine.round_buffers import RoundInputs, RoundResults, RoundSlots

TABLE_BLOCK = 128


@triton.jit
def _round_inputs_kernel(
    anchors_ptr,  # [S] int64
    last_tokens_ptr,  # [S] int64
    live_ptr,  # [S] int64 0/1
    draft_limit_ptr,  # [S] int64
    max_draft_ptr,  # [S] int64
    temperature_ptr,  # [S] float32
    tables_ptr,  # [S, max_blocks] int64, rows contiguous
    out_anchors_ptr,  # [S] int64
    out_last_tokens_ptr,  # [S] int64
    out_live_ptr,  # [S] bool
    out_temperature_ptr,  # [S] float32
    out_num_draft_ptr,  # [S] int64
    input_ids_ptr,  # [S * Q] int64
    positions_ptr,  # [S * Q] int64
    slot_mapping_ptr,  # [S * Q] int64
    context_lens_ptr,  # [S] int64
    query_lens_ptr,  # [S] int64
    block_tables_ptr,  # [S, max_blocks] int64, rows contiguous
    k,
    block_size,
    max_blocks,
    table_stride,
    block_table_stride,
    BLOCK_Q: tl.constexpr,
    TABLE_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    query = k + 1
    anchor = tl.load(anchors_ptr + b)
    last_token = tl.load(last_tokens_ptr + b)
    live = tl.load(live_ptr + b) != 0
    tl.store(out_anchors_ptr + b, anchor)
    tl.store(out_last_tokens_ptr + b, last_token)
    tl.store(out_live_ptr + b, live)
    temperature = tl.load(temperature_ptr + b)
    tl.store(out_temperature_ptr + b, tl.where(live, temperature, 0.0))
    room = tl.maximum(tl.load(draft_limit_ptr + b) - anchor, 0)
    num_draft = tl.minimum(tl.minimum(tl.load(max_draft_ptr + b), room), k)
    tl.store(out_num_draft_ptr + b, tl.where(live, num_draft, 0))
    tl.store(input_ids_ptr + b * query, last_token)
    column = tl.arange(0, BLOCK_Q)
    inside = column < query
    positions = anchor - 1 + column
    # Live slots have anchor >= 1, so positions >= 0 and C-style / and % agree with PyTorch's
    # floor division and remainder; inert slots' values are masked out below.
    block = tl.minimum(tl.maximum(positions // block_size, 0), max_blocks - 1)
    blocks = tl.load(tables_ptr + b * table_stride + block, mask=inside, other=0)
    cache_slots = blocks * block_size + positions % block_size
    zero = tl.zeros([BLOCK_Q], dtype=tl.int64)
    tl.store(positions_ptr + b * query + column, tl.where(live, positions, zero), mask=inside)
    tl.store(
        slot_mapping_ptr + b * query + column, tl.where(live, cache_slots, zero - 1), mask=inside
    )
    tl.store(context_lens_ptr + b, tl.where(live, anchor + k, 0))
    tl.store(query_lens_ptr + b, tl.where(live, query, 0).to(tl.int64))
    for start in range(0, max_blocks, TABLE_BLOCK):
        lanes = start + tl.arange(0, TABLE_BLOCK)
        within = lanes < max_blocks
        row = tl.load(tables_ptr + b * table_stride + lanes, mask=within)
        tl.store(block_tables_ptr + b * block_table_stride + lanes, row, mask=within)


def round_inputs_triton(slots: RoundSlots, out: RoundInputs, k: int, block_size: int) -> None:
    """`round_inputs` on CUDA tensors (the block tables' rows contiguous)."""
    rows, max_blocks = slots.tables.shape
    if rows == 0:
        return
    _round_inputs_kernel[(rows,)](
        slots.anchors,
        slots.last_tokens,
        slots.live,
        slots.draft_limit,
        slots.max_draft,
        slots.temperature,
        slots.tables,
        out.anchors,
        out.last_tokens,
        out.live,
        out.temperature,
        out.num_draft,
        out.input_ids,
        out.positions,
        out.slot_mapping,
        out.context_lens,
        out.query_lens,
        out.block_tables,
        k,
        block_size,
        max_blocks,
        slots.tables.stride(0),
        out.block_tables.stride(0),
        BLOCK_Q=triton.next_power_of_2(k + 1),
        TABLE_BLOCK=TABLE_BLOCK,
    )


@triton.jit
def _finish_round_kernel(
    token_ids_ptr,  # [S, Q] int64, rows contiguous
    num_accepted_ptr,  # [S] int64
    live_ptr,  # [S] bool
    emitted_ptr,  # [S, W] int64
    accepted_ptr,  # [S] int64
    anchors_ptr,  # [S] int64
    last_tokens_ptr,  # [S] int64
    query,
    width,
    token_stride,
    emitted_stride,
    BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0)
    live = tl.load(live_ptr + b).to(tl.int1)
    accepted = tl.where(live, tl.load(num_accepted_ptr + b), 0)
    tl.store(accepted_ptr + b, accepted)
    column = tl.arange(0, BLOCK_W)
    tokens = tl.load(token_ids_ptr + b * token_stride + column, mask=column < query, other=-1)
    tl.store(emitted_ptr + b * emitted_stride + column, tokens, mask=column < width)
    final = tl.load(token_ids_ptr + b * token_stride + accepted)
    anchor = tl.load(anchors_ptr + b)
    last_token = tl.load(last_tokens_ptr + b)
    tl.store(last_tokens_ptr + b, tl.where(live, final, last_token))
    tl.store(anchors_ptr + b, tl.where(live, anchor + accepted + 1, anchor))


def finish_round_triton(
    token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    live: torch.Tensor,
    results: RoundResults,
    anchors: torch.Tensor,
    last_tokens: torch.Tensor,
) -> None:
    """`finish_round` on CUDA tensors (token_ids' and emitted's rows contiguous)."""
    rows, query = token_ids.shape
    if rows == 0:
        return
    width = results.emitted.shape[1]
    _finish_round_kernel[(rows,)](
        token_ids,
        num_accepted,
        live,
        results.emitted,
        results.accepted,
        anchors,
        last_tokens,
        query,
        width,
        token_ids.stride(0),
        results.emitted.stride(0),
        BLOCK_W=triton.next_power_of_2(width),
    )
