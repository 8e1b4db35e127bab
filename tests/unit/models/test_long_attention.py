"""The long-context attention twins on the CPU: the flash-style prefill twin and the split-KV
decode twin against naive softmax attention (paged layouts with holes, chunk boundaries, K + 1
query rows, GQA, sliding windows, FP8 caches), and the KV-cache dtype option.

The Triton kernels themselves run under Triton's CPU interpreter in the tests marked
`interpret` (skipped unless TRITON_INTERPRET=1 and Triton is importable); on a GPU they are
checked by tests/parity/test_long_attention_gpu.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import replace

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.setup import kv_bytes_per_token, resolve_kv_cache_dtype
from specdec.models import attention_tiles, fused, split_kv
from specdec.models.attention import (
    AttentionMetadata,
    DecodeMetadata,
    paged_attention,
    to_cache_dtype,
)
from specdec.models.attention_tiles import (
    DECODE_MAX_BLOCK_M,
    decode_block_m,
    decode_query_bucket,
    decode_row_tiles,
)
from specdec.models.prefill_attention import PREFILL_BLOCK_N, paged_prefill_attention_ref

# float32 twins against float32 naive attention: the same sums in another order.
FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _paged_case(query_lens, context_lens, num_kv_heads, group, head_dim, block_size, seed):
    """Caches with scattered blocks (each table a random, non-contiguous choice) and queries."""
    tables, used = [], 0
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 7
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    for context_len in context_lens:
        count = -(-context_len // block_size)
        tables.append(order[used : used + count])
        used += count
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 1)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 2)
    query = _randn(sum(query_lens), num_kv_heads * group, head_dim, seed=seed + 3)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    return query, k_cache, v_cache, meta


PREFILL_CASES = [
    # (query_lens, context_lens): whole prompts, chunks over a cached prefix, tile boundaries
    # (PREFILL_BLOCK_N = 64 keys), a decode row and an empty share in the same step.
    ([7], [7]),
    ([64, 65, 63], [64, 65, 63]),
    ([40], [300]),
    ([129, 1, 0, 20], [200, 77, 5, 20]),
]


@pytest.mark.parametrize("query_lens,context_lens", PREFILL_CASES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 50])
def test_prefill_twin_matches_naive_attention(query_lens, context_lens, group, window) -> None:
    query, k_cache, v_cache, meta = _paged_case(query_lens, context_lens, 2, group, 16, 16, 3)
    naive = paged_attention(query, k_cache, v_cache, meta, scale=0.3, sliding_window=window)
    twin = paged_prefill_attention_ref(
        query,
        k_cache,
        v_cache,
        meta.cu_seqlens_q,
        meta.context_lens,
        meta.block_tables,
        scale=0.3,
        sliding_window=window,
    )
    live = torch.ones(len(query), dtype=torch.bool)
    torch.testing.assert_close(twin[live], naive[live], **FP32_TOL)
    assert PREFILL_BLOCK_N == 64


def test_prefill_twin_reads_fp8_as_its_values() -> None:
    """An FP8 cache is read as it is (scale 1.0): the twin over it equals the twin over the same
    values held in bfloat16."""
    query, k_cache, v_cache, meta = _paged_case([30, 9], [100, 9], 2, 2, 16, 16, 5)
    query = query.to(torch.bfloat16)
    fp8 = [to_cache_dtype(cache * 30, torch.float8_e4m3fn) for cache in (k_cache, v_cache)]
    wide = [cache.to(torch.bfloat16) for cache in fp8]
    args = (meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    got = paged_prefill_attention_ref(query, *fp8, *args, scale=0.25)
    want = paged_prefill_attention_ref(query, *wide, *args, scale=0.25)
    assert torch.equal(got, want)


def test_fp8_cache_saturates_instead_of_overflowing() -> None:
    values = torch.tensor([1000.0, -1000.0, 448.0, 17.0, 0.3, float("inf")])
    cached = to_cache_dtype(values, torch.float8_e4m3fn).to(torch.float32)
    assert cached.tolist()[:4] == [448.0, -448.0, 448.0, 16.0]  # 17 ties to even: 16
    assert cached[5] == 448.0  # saturated, whatever a plain cast does on this build


def _decode_case(context_lens, query_lens, q_per_seq, num_kv_heads, group, seed):
    block_size, head_dim = 16, 16
    num_seqs = len(context_lens)
    width = max(-(-c // block_size) for c in context_lens) + 2
    num_blocks = num_seqs * width + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = order[: num_seqs * width].view(num_seqs, width)
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 1)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 2)
    query = _randn(num_seqs * q_per_seq, num_kv_heads * group, head_dim, seed=seed + 3)

    def meta(parts: int) -> DecodeMetadata:
        return DecodeMetadata(
            block_tables=tables,
            context_lens=torch.tensor(context_lens),
            query_lens=torch.tensor(query_lens),
            slot_mapping=torch.full((num_seqs * q_per_seq,), -1),
            query_per_seq=q_per_seq,
            num_partitions=parts,
        )

    return query, k_cache, v_cache, meta


@pytest.fixture
def small_partitions(monkeypatch):
    """Partitions of 128 keys (two 64-key steps), so that short contexts span several."""
    monkeypatch.setattr(attention_tiles, "SPLIT_KV_PARTITION", 128)
    return 128


@pytest.mark.parametrize("q_per_seq", [1, 5])
@pytest.mark.parametrize("group", [1, 4])
def test_split_kv_twin_matches_naive_attention(small_partitions, q_per_seq, group) -> None:
    # Contexts at and around partition and step boundaries, an inert sequence (context 0), and
    # a sequence with fewer live query rows than the layout's Q.
    contexts = [1, 64, 127, 128, 129, 300, 0, 700]
    query_lens = [min(q_per_seq, c) for c in contexts]
    query_lens[5] = min(2, q_per_seq)
    query, k_cache, v_cache, meta = _decode_case(contexts, query_lens, q_per_seq, 2, group, 11)
    parts = split_kv.num_partitions(max(contexts)) + 2  # past every context: empty partitions
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0), 0.3)
    got = split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, meta(parts), 0.3)
    torch.testing.assert_close(got, want, **FP32_TOL)
    inert = slice(6 * q_per_seq, 7 * q_per_seq)
    assert (got[inert] == 0).all()
    # The dispatch sends split metadata to the split-KV path on every device.
    dispatched = fused.paged_decode_attention(query, k_cache, v_cache, meta(parts), 0.3)
    assert torch.equal(dispatched, got)


def test_one_partition_combines_to_its_own_output() -> None:
    """A context of one partition gives the single pass's output bit for bit: its combine
    weight is exactly 1."""
    row_max = _randn(3, 8, seed=1)
    row_sum = _randn(3, 8, seed=2).abs() + 0.5
    acc = _randn(3, 8, 16, seed=3)
    combined = split_kv.combine_partials_ref(row_max[None], row_sum[None], acc[None])
    assert torch.equal(combined, acc / row_sum.clamp_min(1e-30)[..., None])


def test_num_partitions_covers_the_context() -> None:
    size = attention_tiles.SPLIT_KV_PARTITION
    assert size % split_kv.DECODE_BLOCK_N == 0
    assert [split_kv.num_partitions(n) for n in (1, size, size + 1, 131072)] == [
        1,
        1,
        2,
        -(-131072 // size),
    ]


def test_split_kv_rules_for_seen_and_unseen_contexts() -> None:
    """Which steps take split-KV (the one rule for the target's decode graphs and the drafters'
    attention): never off CUDA or where one partition covers the cache; steps whose contexts
    the host cannot see from SPLIT_KV_ROUNDS_FROM tokens of cache; steps it sees when their
    longest context spans more than one partition."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    size, unseen_from = attention_tiles.SPLIT_KV_PARTITION, split_kv.SPLIT_KV_ROUNDS_FROM
    assert split_kv.step_partitions(131072, cpu) == 0
    assert split_kv.step_partitions(size, cuda) == 0  # one partition: the single-pass kernel
    assert split_kv.step_partitions(131072, cuda) == split_kv.num_partitions(131072)
    assert split_kv.split_when_unseen(unseen_from, cuda)
    assert not split_kv.split_when_unseen(unseen_from - 1, cuda)
    assert not split_kv.split_when_unseen(131072, cpu)
    partitions = split_kv.step_partitions(8192, cuda)
    assert split_kv.split_when_seen(size + 1, partitions)
    assert not split_kv.split_when_seen(size, partitions)  # both kernels give the same bits
    assert not split_kv.split_when_seen(5000, 0)


# ------------------------------------------------------------------------- the KV-cache dtype
def test_kv_cache_dtype_option() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp16")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cuda) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs CUDA"):
        resolve_kv_cache_dtype("fp8", torch.float32, cpu)


def test_engine_refuses_fp8_cache_on_cpu() -> None:
    from specdec.cli.flags import check_before_loading
    from specdec.engine.llm import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs CUDA"):
        LLM(device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs CUDA"):
        check_before_loading(EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3"))


def test_fp8_cache_halves_kv_bytes() -> None:
    from models_fixtures import seeded_model

    model = seeded_model("llama", "cpu", dtype=torch.bfloat16)
    cfg = model.config
    bf16 = kv_bytes_per_token(model, torch.bfloat16)
    assert bf16 == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    assert kv_bytes_per_token(model, torch.float8_e4m3fn) * 2 == bf16
    # A drafter's cache layers keep the model's dtype.
    assert kv_bytes_per_token(model, torch.float8_e4m3fn, 1) == bf16 // 2 + bf16 // (
        cfg.num_hidden_layers
    )


# ------------------------------------------------- the Triton kernels under the interpreter
@interpret
@pytest.mark.parametrize("query_lens,context_lens", PREFILL_CASES)
@pytest.mark.parametrize("window", [None, 50])
def test_prefill_kernel_interpreted_matches_twin(query_lens, context_lens, window) -> None:
    from specdec.models.prefill_attention_triton import paged_prefill_attention_triton

    query, k_cache, v_cache, meta = _paged_case(query_lens, context_lens, 2, 2, 16, 16, 7)
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    twin = paged_prefill_attention_ref(*args, scale=0.3, sliding_window=window)
    got = paged_prefill_attention_triton(*args, meta.max_seqlen_q, scale=0.3, sliding_window=window)
    torch.testing.assert_close(got, twin, **FP32_TOL)


@interpret
@pytest.mark.parametrize("q_per_seq", [1, 5])
def test_split_kv_kernels_interpreted_match_twin(small_partitions, q_per_seq) -> None:
    from specdec.models import fused_triton, split_kv_triton

    contexts = [1, 128, 129, 300, 0]
    query_lens = [min(q_per_seq, c) for c in contexts]
    query, k_cache, v_cache, meta = _decode_case(contexts, query_lens, q_per_seq, 2, 4, 13)
    got = split_kv_triton.split_kv_decode_attention_triton(query, k_cache, v_cache, meta(5), 0.3)
    twin = split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, meta(5), 0.3)
    torch.testing.assert_close(got, twin, **FP32_TOL)
    single = fused_triton.paged_decode_attention_triton(query, k_cache, v_cache, meta(0), 0.3)
    # The single-pass kernel merges at the same partition edges: its bits at every context,
    # one partition (sequences 0, 1, 4) or several (2, 3; s33).
    for b in range(len(contexts)):
        rows = slice(b * q_per_seq, (b + 1) * q_per_seq)
        assert torch.equal(got[rows], single[rows]), f"sequence {b}"


@pytest.mark.parametrize("query_lens,context_lens", PREFILL_CASES)
@pytest.mark.parametrize("window", [None, 50])
def test_prefill_twin_over_partitions_matches_naive_attention(
    small_partitions, query_lens, context_lens, window
) -> None:
    """Contexts across several partitions (of 128 keys here): the twin's per-partition passes
    and merges still compute the attention."""
    query, k_cache, v_cache, meta = _paged_case(query_lens, context_lens, 2, 2, 16, 16, 5)
    naive = paged_attention(query, k_cache, v_cache, meta, scale=0.3, sliding_window=window)
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    twin = paged_prefill_attention_ref(*args, scale=0.3, sliding_window=window)
    torch.testing.assert_close(twin, naive, **FP32_TOL)


@interpret
@pytest.mark.parametrize("window", [None, 50])
def test_prefill_kernel_over_partitions_interpreted(small_partitions, window) -> None:
    """The prefill kernel merging at partition edges (contexts up to 300 keys, partitions of
    128) against its twin, and each of its rows against the same token's row from the decode
    kernels (single-pass and split-KV) with the token's own context: the bits a request's
    recomputed prefix must reproduce after preemption (s33)."""
    from specdec.models import fused_triton, split_kv_triton
    from specdec.models.prefill_attention_triton import paged_prefill_attention_triton

    query_lens, context_lens = [40, 129, 20], [300, 200, 20]
    query, k_cache, v_cache, meta = _paged_case(query_lens, context_lens, 2, 2, 16, 16, 9)
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    twin = paged_prefill_attention_ref(*args, scale=0.3, sliding_window=window)
    got = paged_prefill_attention_triton(*args, meta.max_seqlen_q, scale=0.3, sliding_window=window)
    torch.testing.assert_close(got, twin, **FP32_TOL)
    # Token j of sequence 0 (position 260 + j) as a decode row of its own context.
    tables = meta.block_tables[:1]
    for j in (0, 3, 39):
        position = context_lens[0] - query_lens[0] + j
        decode = DecodeMetadata(
            block_tables=tables,
            context_lens=torch.tensor([position + 1]),
            query_lens=torch.tensor([1]),
            slot_mapping=torch.full((1,), -1),
            query_per_seq=1,
            num_partitions=0,
        )
        row = query[j : j + 1]
        single = fused_triton.paged_decode_attention_triton(
            row, k_cache, v_cache, decode, 0.3, sliding_window=window
        )
        split = split_kv_triton.split_kv_decode_attention_triton(
            row,
            k_cache,
            v_cache,
            replace(decode, num_partitions=3),
            0.3,
            sliding_window=window,
        )
        assert torch.equal(single, split), f"token {j}: single-pass against split-KV"
        diff = (single - got[j : j + 1]).abs().max().item()
        assert diff < 2e-5, f"token {j}: decode against prefill, {diff:.2e}"


@interpret
def test_negative_control_one_pass_over_partitions_differs(small_partitions, monkeypatch) -> None:
    """Without the merges at partition edges (the single pass over every key, as before s33),
    a context of several partitions gets other bits than split-KV gives it: the comparison
    above can fail."""
    from specdec.models import fused_triton, split_kv_triton

    contexts = [129, 300]
    query, k_cache, v_cache, meta = _decode_case(contexts, [1, 1], 1, 2, 4, 13)
    split = split_kv_triton.split_kv_decode_attention_triton(query, k_cache, v_cache, meta(5), 0.3)
    monkeypatch.setattr(fused_triton, "kernel_partition", lambda max_keys: 0)  # as imported
    single = fused_triton.paged_decode_attention_triton(query, k_cache, v_cache, meta(0), 0.3)
    torch.testing.assert_close(single, split, **FP32_TOL)  # the same attention
    assert not torch.equal(single, split)  # in other bits


def test_decode_query_bucket_keeps_the_tile() -> None:
    """A width padded to its bucket keeps the decode kernels' BLOCK_M (so its rows' bits), and
    the buckets of widths 1..16 are few (the kernel variants a data-driven width can need)."""
    for group in range(1, 17):
        buckets = set()
        for width in range(1, 17):
            block_m = min(DECODE_MAX_BLOCK_M, max(16, 2 ** math.ceil(math.log2(width * group))))
            assert decode_block_m(width, group) == block_m
            bucket = decode_query_bucket(width, group, 16)
            assert width <= bucket <= 16 and decode_block_m(bucket, group) == block_m
            buckets.add(bucket)
        assert len(buckets) <= 5, (group, sorted(buckets))
    assert sorted({decode_query_bucket(w, 3, 16) for w in range(1, 17)}) == [5, 16]
    assert decode_query_bucket(20, 3, 16) == 20  # past the limit: as it is
    if importlib.util.find_spec("triton"):
        import triton

        for n in range(0, 300):
            assert decode_block_m(n, 1) == min(32, max(16, triton.next_power_of_2(n)))
    # Past DECODE_MAX_BLOCK_M rows the kernels take more programs, never a wider tile (on
    # Hopper a 64-row tile compiles to another matrix instruction: other bits).
    assert DECODE_MAX_BLOCK_M == 32
    assert [decode_row_tiles(q, g) for q, g in ((1, 3), (16, 3), (5, 8), (16, 8))] == [1, 2, 2, 4]


def _in_layout(rows: torch.Tensor, num_seqs: int, width: int, padded: int) -> torch.Tensor:
    """[num_seqs * width, ...] rows laid out `padded` rows per sequence (padding rows random)."""
    out = _randn(num_seqs * padded, *rows.shape[1:], seed=99, dtype=rows.dtype)
    out = out.view(num_seqs, padded, *rows.shape[1:])
    out[:, :width] = rows.view(num_seqs, width, *rows.shape[1:])
    return out.flatten(0, 1)


@interpret
@pytest.mark.parametrize("width", [2, 7, 12, 13])
def test_padding_to_the_query_bucket_keeps_each_rows_bits_interpreted(
    small_partitions, width
) -> None:
    """The decode kernels (single-pass and split-KV) over a layout padded to its bucket give
    every live row the bits of the unpadded layout (the EAGLE head's eager catch-up pads so),
    and match their twins, past DECODE_MAX_BLOCK_M rows (several row tiles) too."""
    from specdec.models import fused_triton, split_kv_triton

    group, contexts = 3, [1, 70, 129, 300, 0]
    split_kv_twin = split_kv.split_kv_decode_attention_ref
    query_lens = [min(width, c) for c in contexts]
    query_lens[3] = 1
    query, k_cache, v_cache, meta = _decode_case(contexts, query_lens, width, 2, group, 17)
    bucket = decode_query_bucket(width, group, 16)
    assert bucket > width
    padded_query = _in_layout(query, len(contexts), width, bucket)
    for parts in (0, 5):
        launch = (
            fused_triton.paged_decode_attention_triton
            if parts == 0
            else split_kv_triton.split_kv_decode_attention_triton
        )
        want = launch(query, k_cache, v_cache, meta(parts), 0.3)
        # Every row written right, those of the second row tile too (width 13: 39 rows).
        twin = fused.paged_decode_attention_ref if parts == 0 else split_kv_twin
        torch.testing.assert_close(want, twin(query, k_cache, v_cache, meta(parts), 0.3))
        slots = torch.full((len(contexts) * bucket,), -1)
        wide = replace(meta(parts), query_per_seq=bucket, slot_mapping=slots)
        got = launch(padded_query, k_cache, v_cache, wide, 0.3)
        got = got.view(len(contexts), bucket, *got.shape[1:])[:, :width]
        assert torch.equal(got.flatten(0, 1), want), f"partitions {parts}"
