"""Paged attention against a dense per-sequence reference; slot writes; metadata building."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.models import AttentionMetadata, KVCache, paged_attention, write_kv


def test_build_slot_mapping() -> None:
    # seq 0: 3 new tokens at positions 2..4 in blocks [5, 1]; seq 1: one token at position 0.
    attn = AttentionMetadata.build([3, 1], [5, 1], [[5, 1], [2]], block_size=4)
    assert attn.cu_seqlens_q.tolist() == [0, 3, 4]
    assert attn.context_lens.tolist() == [5, 1]
    assert attn.block_tables.tolist() == [[5, 1], [2, -1]]
    assert attn.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3, 1 * 4 + 0, 2 * 4 + 0]
    assert (attn.max_seqlen_q, attn.max_context_len, attn.num_seqs) == (3, 5, 2)


def test_build_rejects_short_tables() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([2], [9], [[0, 1]], block_size=4)
    with pytest.raises(ValueError, match="query_len <= context_len"):
        AttentionMetadata.build([3], [2], [[0]], block_size=4)


def test_write_kv_skips_negative_slots() -> None:
    cache = KVCache.allocate(1, 3, 2, 1, 4)
    key = torch.arange(12, dtype=torch.float32).reshape(3, 1, 4) + 1
    write_kv(key, -key, cache.k_cache[0], cache.v_cache[0], torch.tensor([5, -1, 0]))
    flat_k = cache.k_cache[0].reshape(6, 4)
    assert torch.equal(flat_k[5], key[0, 0])
    assert torch.equal(flat_k[0], key[2, 0])
    assert flat_k[1:5].abs().sum() == 0
    assert torch.equal(cache.v_cache[0].reshape(6, 4)[5], -key[0, 0])


def _dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Reference: query [q, Hq, D] at the last q positions of keys/values [L, Hkv, D]."""
    q_len, num_heads, head_dim = query.shape
    ctx_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for j in range(q_len):
        pos = ctx_len - q_len + j
        for h in range(num_heads):
            scores = [
                float(query[j, h] @ keys[k, h // group]) / math.sqrt(head_dim)
                if k <= pos and (window is None or k > pos - window)
                else -math.inf
                for k in range(ctx_len)
            ]
            weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
            out[j, h] = (weights[:, None] * values[:, h // group].double()).sum(0).float()
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_matches_dense(window: int | None) -> None:
    """Chunked prefill, multi-token verify and decode steps over scattered blocks."""
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    total = [10, 3, 7]
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=generator) for n in total]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=generator) for n in total]
    queries = [torch.randn(n, num_heads, head_dim, generator=generator) for n in total]
    tables = [[7, 2, 9], [4], [0, 8]]  # non-contiguous, interleaved
    cache = KVCache.allocate(1, 10, block_size, num_kv_heads, head_dim)
    # (query_len per sequence) for each step; a 0 leaves the sequence out of that step.
    steps = [[6, 2, 1], [3, 1, 4], [1, 0, 2]]
    done = [0, 0, 0]
    for step in steps:
        seqs = [b for b in range(3) if step[b] > 0]
        query_lens = [step[b] for b in seqs]
        context_lens = [done[b] + step[b] for b in seqs]
        attn = AttentionMetadata.build(
            query_lens, context_lens, [tables[b] for b in seqs], block_size
        )
        new = [slice(done[b], done[b] + step[b]) for b in seqs]
        key = torch.cat([keys[b][s] for b, s in zip(seqs, new, strict=True)])
        value = torch.cat([values[b][s] for b, s in zip(seqs, new, strict=True)])
        query = torch.cat([queries[b][s] for b, s in zip(seqs, new, strict=True)])
        write_kv(key, value, cache.k_cache[0], cache.v_cache[0], attn.slot_mapping)
        out = paged_attention(
            query,
            cache.k_cache[0],
            cache.v_cache[0],
            attn,
            scale=head_dim**-0.5,
            sliding_window=window,
        )
        for part, b, ctx_len in zip(out.split(query_lens), seqs, context_lens, strict=True):
            expected = _dense_attention(
                queries[b][done[b] : ctx_len], keys[b][:ctx_len], values[b][:ctx_len], window
            )
            torch.testing.assert_close(part, expected, atol=1e-5, rtol=1e-5)
        for b in seqs:
            done[b] += step[b]


def test_empty_sequence_in_batch_is_inert() -> None:
    """A padded row (no query tokens, no context) neither breaks nor changes the others."""
    generator = torch.Generator().manual_seed(1)
    cache = KVCache.allocate(1, 4, 4, 1, 8)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=generator))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=generator))
    query = torch.randn(2, 1, 8, generator=generator)
    alone = AttentionMetadata.build([2], [5], [[3, 1]], 4)
    padded = AttentionMetadata.build([2, 0], [5, 0], [[3, 1], []], 4)
    args = (cache.k_cache[0], cache.v_cache[0])
    out_alone = paged_attention(query, *args, alone, scale=0.3)
    out_padded = paged_attention(query, *args, padded, scale=0.3)
    assert torch.isfinite(out_padded).all()
    torch.testing.assert_close(out_alone, out_padded, atol=1e-6, rtol=0)
