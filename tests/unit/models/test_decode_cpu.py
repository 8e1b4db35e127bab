"""The CPU decode step's RoPE/K/V write and attention against their twins in `fused.py`, on
mixed batches: one sequence (contiguous and scattered blocks), several with verify rows of
different lengths, and an inert padding sequence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specdec.models.attention import DecodeMetadata, cache_slots
from specdec.models.decode_cpu import DecodePlanCPU, decode_attention_cpu, rope_write_kv_cpu
from specdec.models.fused import paged_decode_attention_ref, rope_write_kv_ref

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def _step(tables: list[list[int]], starts: list[int], counts: list[int], per_seq: int):
    """Decode metadata and positions of a step (count 0: an inert padding sequence)."""
    width = max(len(t) for t in tables)
    block_tables = np.full((len(tables), width), -1, dtype=np.int64)
    positions = np.zeros((len(tables), per_seq), dtype=np.int64)
    slots = np.full((len(tables), per_seq), -1, dtype=np.int64)
    for b, (table, start, count) in enumerate(zip(tables, starts, counts, strict=True)):
        block_tables[b, : len(table)] = table
        if count:
            pos = np.arange(start, start + count)
            positions[b, :count] = pos
            slots[b, :count] = cache_slots(table, pos, BLOCK)
    context = [start + count if count else 0 for start, count in zip(starts, counts, strict=True)]
    meta = DecodeMetadata(
        block_tables=torch.from_numpy(block_tables),
        context_lens=torch.tensor(context),
        query_lens=torch.tensor(counts),
        slot_mapping=torch.from_numpy(slots.reshape(-1)),
        query_per_seq=per_seq,
    )
    return meta, torch.from_numpy(positions.reshape(-1))


CASES = {
    "one sequence, contiguous": ([[0, 1, 2]], [9], [1], 1),
    "one sequence, scattered": ([[7, 2, 5]], [10], [1], 1),
    "verify rows and padding": ([[3, 8], [1, 4, 6], [0]], [5, 6, 0], [3, 2, 0], 3),
}


@pytest.mark.parametrize("case", CASES)
def test_cpu_step_matches_twins(case: str) -> None:
    tables, starts, counts, per_seq = CASES[case]
    meta, positions = _step(tables, starts, counts, per_seq)
    generator = torch.Generator().manual_seed(len(case))
    shape = (10, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    qkv = torch.randn(positions.shape[0], (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, DIM, 2).float() / DIM))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_query = rope_write_kv_ref(
        qkv, positions, inv_freq, ref_k, ref_v, meta.slot_mapping, HEADS, KV_HEADS
    )
    plan = DecodePlanCPU.build(meta, positions, inv_freq, BLOCK)
    query = rope_write_kv_cpu(qkv, plan, k_cache, v_cache, HEADS, KV_HEADS)
    assert torch.equal(query, ref_query)  # the same float32 products
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    scale = DIM**-0.5
    live = torch.tensor([j < count for count in counts for j in range(per_seq)])
    want = paged_decode_attention_ref(ref_query, ref_k, ref_v, meta, scale)[live]
    got = decode_attention_cpu(query, k_cache, v_cache, plan, scale)
    assert torch.allclose(got[live], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))  # padding rows stay 0
    # Each row is what a one-row step of that token computes (verify row == decode row).
    for b, (start, count) in enumerate(zip(starts, counts, strict=True)):
        for j in range(count):
            one, one_pos = _step([tables[b]], [start + j], [1], 1)
            alone = DecodePlanCPU.build(one, one_pos, inv_freq, BLOCK)
            row = b * per_seq + j
            single = decode_attention_cpu(query[row : row + 1], k_cache, v_cache, alone, scale)
            assert torch.equal(single[0], got[row])
    # Negative control: attention over a cache with one written key changed differs.
    k_cache.view(-1, KV_HEADS, DIM)[int(meta.slot_mapping[0])] += 1.0
    changed = decode_attention_cpu(query, k_cache, v_cache, plan, scale)
    assert not torch.allclose(changed[live], want, atol=1e-5, rtol=1e-5)


def test_inert_rows_read_no_other_sequence() -> None:
    """Keys past a sequence's context are read from its own position 0, so NaN in blocks it
    does not own cannot reach it; an inert sequence's rows are 0."""
    tables, starts, counts, per_seq = CASES["verify rows and padding"]
    meta, positions = _step(tables, starts, counts, per_seq)
    k_cache = torch.full((10, BLOCK, KV_HEADS, DIM), math.nan)
    v_cache = torch.full_like(k_cache, math.nan)
    owned = {3, 8, 1, 4, 6}
    for block in owned:
        k_cache[block] = 0.5
        v_cache[block] = 0.25
    qkv = torch.ones(positions.shape[0], (HEADS + 2 * KV_HEADS) * DIM)
    inv_freq = torch.ones(DIM // 2)
    plan = DecodePlanCPU.build(meta, positions, inv_freq, BLOCK)
    query = rope_write_kv_cpu(qkv, plan, k_cache, v_cache, HEADS, KV_HEADS)
    out = decode_attention_cpu(query, k_cache, v_cache, plan, DIM**-0.5)
    live_rows = 2 * per_seq
    assert torch.isfinite(out[:live_rows]).all()
    assert torch.equal(out[live_rows:], torch.zeros_like(out[live_rows:]))
