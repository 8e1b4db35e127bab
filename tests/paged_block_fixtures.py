"""Test helpers for the block drafters' paged context: paged pools with holes and the naive
attention a block's rows should compute over them (inputs from seeded generators, tests only)."""

from __future__ import annotations

import torch

from specdec.models.attention import DecodeMetadata


def context_meta(tables, context_lens, rows: int, num_partitions: int = 0) -> DecodeMetadata:
    """The metadata of `rows` query rows a slot seeing their whole paged context (query_lens 0),
    as `paged_context.paged_block_attention` builds it."""
    return DecodeMetadata(
        block_tables=tables,
        context_lens=context_lens,
        query_lens=torch.zeros_like(context_lens),
        slot_mapping=context_lens[:0],
        query_per_seq=rows,
        num_partitions=num_partitions,
    )


def randn(*shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def paged_layout(
    context_lens, num_kv_heads, head_dim, seed, block_size=16, dtype=torch.float32, device="cpu"
):
    """Pools whose block tables are random, non-contiguous choices (holes); entries past a
    context name unused blocks."""
    counts = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(counts) + 9
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    max_blocks = max(counts) + 2
    tables = torch.full((len(context_lens), max_blocks), num_blocks - 1, dtype=torch.int64)
    used = 0
    for n, count in enumerate(counts):
        tables[n, :count] = order[used : used + count]
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = randn(*shape, seed=seed + 1, dtype=dtype, device=device)
    v_pool = randn(*shape, seed=seed + 2, dtype=dtype, device=device)
    return k_pool, v_pool, tables.to(device), torch.tensor(context_lens, device=device)


def naive_block_attention(
    query, key, value, k_pool, v_pool, tables, context_lens, scale, softcap=None
):
    """Softmax over [context keys 0..L-1, the block's own keys], one block at a time, in
    float32 (scores cap * tanh(scores / cap) with a softcap)."""
    query, key, value = query.float(), key.float(), value.float()
    k_pool, v_pool = k_pool.float(), v_pool.float()
    num_heads = query.shape[2]
    group = num_heads // key.shape[2]
    out = torch.empty_like(query)
    for b, length in enumerate(context_lens.tolist()):
        keys = torch.cat([k_pool[tables[b]].flatten(0, 1)[:length], key[b]])  # [L + R, H_kv, D]
        values = torch.cat([v_pool[tables[b]].flatten(0, 1)[:length], value[b]])
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L + R, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = query[b].transpose(0, 1) @ keys.transpose(-1, -2) * scale  # [H, R, L + R]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out
