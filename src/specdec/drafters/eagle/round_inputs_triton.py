"""The Triton kernel behind `specdec.drafters.eagle.round_inputs.head_round_inputs`: one program
per slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.drafters.eagle.step_inputs import HeadRoundInputs


@triton.jit
def _cache_slots(tables_ptr, row_start, entries, mask, block_size, max_blocks):
    """Cache slots of entries >= 0 (C-style / and % agree with floor division there)."""
    block = tl.minimum(entries // block_size, max_blocks - 1)
    blocks = tl.load(tables_ptr + row_start + block, mask=mask, other=0)
    return blocks * block_size + entries % block_size


@triton.jit
def _head_round_inputs_kernel(
    anchors_ptr,  # [S] int64
    live_ptr,  # [S] bool
    counts_ptr,  # [S] int64
    entry_tokens_ptr,  # [S, W] int64, rows contiguous
    tables_ptr,  # [S, max_blocks] int64, rows contiguous
    catch_slots_ptr,  # [S * W] int64
    catch_positions_ptr,  # [S * W]
    catch_tokens_ptr,  # [S * W]
    catch_context_lens_ptr,  # [S]
    catch_query_lens_ptr,  # [S]
    catch_ends_ptr,  # [S]
    chain_slots_ptr,  # [K - 1, S]
    chain_positions_ptr,  # [K - 1, S]
    chain_query_lens_ptr,  # [S]
    draft_positions_ptr,  # [K, S]
    width,
    steps,
    block_size,
    max_blocks,
    tokens_stride,
    table_stride,
    chain_stride,
    draws,
    draft_stride,
    BLOCK_W: tl.constexpr,
    BLOCK_STEPS: tl.constexpr,
    BLOCK_DRAWS: tl.constexpr,
):
    b = tl.program_id(0)
    anchor = tl.load(anchors_ptr + b)
    live = tl.load(live_ptr + b).to(tl.int1)
    count = tl.load(counts_ptr + b)
    table_row = b * table_stride
    zero_w = tl.zeros([BLOCK_W], dtype=tl.int64)
    column = tl.arange(0, BLOCK_W)
    inside = column < width
    entries = anchor - 1 - count + column
    fed = live & (column < count) & inside
    slots = _cache_slots(
        tables_ptr, table_row, tl.maximum(entries, 0), inside, block_size, max_blocks
    )
    tokens = tl.load(entry_tokens_ptr + b * tokens_stride + column, mask=inside, other=0)
    at = b * width + column
    tl.store(catch_slots_ptr + at, tl.where(fed, slots, zero_w - 1), mask=inside)
    tl.store(catch_positions_ptr + at, tl.where(fed, entries + 1, zero_w), mask=inside)
    tl.store(catch_tokens_ptr + at, tl.where(fed, tokens, zero_w), mask=inside)
    tl.store(catch_context_lens_ptr + b, tl.where(live, anchor - 1, 0))
    tl.store(catch_query_lens_ptr + b, tl.where(live, count, 0))
    tl.store(catch_ends_ptr + b, b * width + tl.maximum(count - 1, 0))
    step = tl.arange(0, BLOCK_STEPS)
    within = step < steps
    chained = anchor - 1 + step
    zero_s = tl.zeros([BLOCK_STEPS], dtype=tl.int64)
    slots = _cache_slots(
        tables_ptr, table_row, tl.maximum(chained, 0), within, block_size, max_blocks
    )
    at = step * chain_stride + b
    tl.store(chain_slots_ptr + at, tl.where(live, slots, zero_s - 1), mask=within)
    tl.store(chain_positions_ptr + at, tl.where(live, chained + 1, zero_s), mask=within)
    tl.store(chain_query_lens_ptr + b, live.to(tl.int64))
    draw = tl.arange(0, BLOCK_DRAWS)
    tl.store(draft_positions_ptr + draw * draft_stride + b, anchor + draw, mask=draw < draws)


def head_round_inputs_triton(
    anchors: torch.Tensor,
    live: torch.Tensor,
    counts: torch.Tensor,
    entry_tokens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    out: HeadRoundInputs,
) -> None:
    """`head_round_inputs` on CUDA tensors (entry_tokens', tables' and the chain outputs' rows
    contiguous)."""
    rows, width = entry_tokens.shape
    if rows == 0:
        return
    steps, draws = out.chain_slots.shape[0], out.draft_positions.shape[0]
    _head_round_inputs_kernel[(rows,)](
        anchors,
        live,
        counts,
        entry_tokens,
        tables,
        out.catch_slots,
        out.catch_positions,
        out.catch_tokens,
        out.catch_context_lens,
        out.catch_query_lens,
        out.catch_ends,
        out.chain_slots,
        out.chain_positions,
        out.chain_query_lens,
        out.draft_positions,
        width,
        steps,
        block_size,
        tables.shape[1],
        entry_tokens.stride(0),
        tables.stride(0),
        out.chain_slots.stride(0),
        draws,
        out.draft_positions.stride(0),
        BLOCK_W=triton.next_power_of_2(width),
        BLOCK_STEPS=max(triton.next_power_of_2(steps), 1),
        BLOCK_DRAWS=max(triton.next_power_of_2(draws), 1),
    )
