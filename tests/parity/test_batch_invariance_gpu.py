"""Batch invariance of the CUDA step's parts, bit for bit: a row's value must not depend on what
else its product or its attention call holds.

- The row-invariant GEMM (`models/linear_triton.py`): a row computed alone, among any number of
  rows, and under every tile `linear_tile` can pick, gives the same bits (the kernel relies on
  `tl.dot` giving a row's bits independently of the tile; this test is that assumption's guard).
- `batch_invariant_linear` after `check_cublas_rows`: cuBLAS kept only where it passed, every row
  equal to the row alone either way, on random rows and on rows whose bits change with any change
  of the summation order; a negative control (plain F.linear on a weight cuBLAS fails) must
  differ.
- Attention: a token's row is the same bits from the prefill kernel (every position of chunks
  of 40 to 4,096 tokens, past one 2,048-key partition too), the decode kernel alone (Q = 1), as
  a verify row and as a graphed prefill row (Q = 5, 16), and split-KV over one partition and
  over two.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models import linear as linear_module
from specdec.models.attention import DecodeMetadata

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from specdec.models.fused_triton import paged_decode_attention_triton  # noqa: E402
from specdec.models.linear_triton import LinearTile, launch_linear, linear_tile  # noqa: E402
from specdec.models.prefill_attention_triton import paged_prefill_attention_triton  # noqa: E402
from specdec.models.split_kv import split_kv_decode_attention  # noqa: E402

# SmolLM2's, Llama-3-8B's, and the Qwen3-30B-A3B shape's attention products and router (the
# deep decode tiles of s38).
SHAPES = [
    (960, 576),
    (3072, 576),
    (576, 1536),
    (49152, 576),
    (4096, 4096),
    (4096, 14336),
    (5120, 2048),
    (2048, 4096),
    (128, 2048),
]


def _randn(*shape, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=generator)


@pytest.mark.parametrize(("cols", "depth"), SHAPES)
def test_gemm_rows_do_not_depend_on_row_count_or_tile(cols: int, depth: int) -> None:
    weight = (_randn(cols, depth, seed=0) * 0.05).bfloat16()
    x = _randn(600, depth, seed=1).bfloat16()
    alone = torch.cat(
        [_kernel(x[i : i + 1], weight, linear_tile(1, cols, depth)) for i in range(24)]
    )
    tiles = {linear_tile(rows, cols, depth) for rows in (1, 16, 17, 128, 129, 512, 513)}
    tiles |= {LinearTile(16, 64, 64, 4, 3), LinearTile(128, 256, 64, 8, 3)}
    for rows in (2, 7, 16, 24, 64, 200, 600):
        for tile in tiles:
            out = _kernel(x[:rows], weight, tile)
            assert torch.equal(out[: min(rows, 24)], alone[: min(rows, 24)]), (rows, tile)
    # The twin: equal up to the float32 accumulation order.
    want = linear_module.batch_invariant_linear_ref(x[:64], weight).float()
    got = _kernel(x[:64], weight, tiles.pop()).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _kernel(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], device="cuda", dtype=x.dtype)
    launch_linear(x, weight, None, out, tile)
    return out


def test_dispatch_rows_equal_alone_and_negative_control() -> None:
    small = (_randn(960, 576, seed=2) * 0.05).bfloat16()
    large = (_randn(4096, 4096, seed=3) * 0.02).bfloat16()
    max_rows = 200
    passed = linear_module.check_cublas_rows([small, large], max_rows)
    assert set(passed) == {
        (960, 576, torch.bfloat16, small.device),
        (4096, 4096, torch.bfloat16, large.device),
    }
    for weight in (small, large):
        depth = weight.shape[1]
        x = _randn(300, depth, seed=4).bfloat16()
        alone = torch.cat(
            [linear_module.batch_invariant_linear(x[i : i + 1], weight) for i in range(300)]
        )
        for rows in (3, 64, 150, 200, 300):  # 300 > max_rows: cuBLAS in slices of 200
            out = linear_module.batch_invariant_linear(x[:rows], weight)
            assert torch.equal(out, alone[:rows]), (weight.shape, rows)
    if not passed[(4096, 4096, torch.bfloat16, large.device)]:
        # Negative control: cuBLAS itself on the weight it failed gives a row other bits.
        x = _randn(200, 4096, seed=5).bfloat16()
        alone = torch.cat([F.linear(x[i : i + 1], large) for i in range(8)])
        assert any(not torch.equal(F.linear(x[:rows], large)[:8], alone) for rows in (64, 128, 200))


@pytest.mark.parametrize(
    ("cols", "depth", "dtype"),
    [
        (97, 64, torch.bfloat16),
        (192, 64, torch.bfloat16),
        (576, 576, torch.bfloat16),
        (1536, 576, torch.bfloat16),
        (4096, 4096, torch.bfloat16),
        (97, 64, torch.float32),
    ],
)
def test_dispatch_rows_equal_alone_on_order_sensitive_rows(cols, depth, dtype) -> None:
    """The dispatch after the start-up check, on rows that change bits with any change of the
    summation order (s33: the tiny model's 97 x 64 bfloat16 head passed the check on `sin`
    inputs alone, and its rows changed bits at 5 rows in the engine). Where the check failed
    the shape, cuBLAS itself must give some row other bits (the reason reproduces)."""
    weight = torch.ones(cols, depth, device="cuda", dtype=dtype)
    linear_module._CUBLAS_ROWS.pop((cols, depth, dtype, weight.device), None)
    max_rows = 256
    passed = linear_module.check_cublas_rows([weight], max_rows)[
        (cols, depth, dtype, weight.device)
    ]
    x = linear_module.order_sensitive_rows(300, depth, dtype, "cuda")
    alone = torch.cat(
        [linear_module.batch_invariant_linear(x[i : i + 1], weight) for i in range(300)]
    )
    for rows in (*range(2, 17), 31, 64, 65, 200, 256, 300):
        out = linear_module.batch_invariant_linear(x[:rows], weight)
        assert torch.equal(out, alone[:rows]), (cols, depth, dtype, passed, rows)
    if not passed:
        raw_alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(max_rows)])
        assert any(
            not torch.equal(F.linear(x[:rows], weight), raw_alone[:rows])
            for rows in range(2, max_rows + 1)
        )


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 128)])
def test_token_rows_equal_across_attention_kernels(heads: int, kv_heads: int, dim: int) -> None:
    num_blocks, block = 256, 16
    k_cache = _randn(num_blocks, block, kv_heads, dim, seed=6).bfloat16()
    v_cache = _randn(num_blocks, block, kv_heads, dim, seed=7).bfloat16()
    table = torch.arange(num_blocks, device="cuda", dtype=torch.int32)[None]
    scale = dim**-0.5

    def decode(queries: torch.Tensor, context: int) -> torch.Tensor:
        width = queries.shape[0]
        meta = DecodeMetadata(
            block_tables=table,
            context_lens=torch.tensor([context], device="cuda", dtype=torch.int32),
            query_lens=torch.tensor([width], device="cuda", dtype=torch.int32),
            slot_mapping=torch.full((width,), -1, device="cuda", dtype=torch.int64),
            query_per_seq=width,
        )
        return paged_decode_attention_triton(queries, k_cache, v_cache, meta, scale)

    # Past 2,048 keys (one split-KV partition) every kernel merges at the partition edges (s33).
    for length in (40, 700, 2000, 2049, 3000, 4096):
        queries = _randn(length, heads, dim, seed=length).bfloat16()
        prefill = paged_prefill_attention_triton(
            queries,
            k_cache,
            v_cache,
            torch.tensor([0, length], device="cuda", dtype=torch.int32),
            torch.tensor([length], device="cuda", dtype=torch.int32),
            table,
            length,
            scale=scale,
        )
        for pos in range(0, length, max(1, length // 50)):
            alone = decode(queries[pos : pos + 1], pos + 1)[0]
            assert torch.equal(prefill[pos], alone), (length, pos)
        for width in (5, 16):  # a verify step, a graphed prefill chunk
            end = length
            rows = decode(queries[end - width : end], end)
            assert torch.equal(rows, prefill[end - width : end]), (length, width)
    # Split-KV gives the single pass's bits, over one partition and over two.
    for context in (1000, 3500):
        queries = _randn(16, heads, dim, seed=9).bfloat16()
        single = decode(queries, context)
        meta = DecodeMetadata(
            block_tables=table,
            context_lens=torch.tensor([context], device="cuda", dtype=torch.int32),
            query_lens=torch.tensor([16], device="cuda", dtype=torch.int32),
            slot_mapping=torch.full((16,), -1, device="cuda", dtype=torch.int64),
            query_per_seq=16,
            num_partitions=4,
        )
        split = split_kv_decode_attention(queries, k_cache, v_cache, meta, scale)
        assert torch.equal(split, single), context


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 128)])
def test_a_decode_row_keeps_its_bits_in_wider_layouts(heads: int, kv_heads: int, dim: int) -> None:
    """A decode row (one live query token) gives the same bits alone (Q = 1) as in a verify
    layout (Q = 5) and in a 16-token graphed-prefill layout whose other rows are padding (the
    step it shares with another request's prefill chunk), on data with a trained model's range
    (channels scaled by exp(2 N(0, 1))). On this data a 64-row tile (the kernels before s22) gave
    the same bits too (H200, s22): the built-in model's weights showed the fault where this
    data does not, so the negative control is `test_replay_gpu.py`'s
    `test_a_wide_attention_tile_breaks_replay`."""
    num_blocks, block = 64, 16
    channel = torch.exp(2 * _randn(dim, seed=11))
    k_cache = (_randn(num_blocks, block, kv_heads, dim, seed=12) * channel).bfloat16()
    v_cache = (_randn(num_blocks, block, kv_heads, dim, seed=13) * channel).bfloat16()
    table = torch.arange(num_blocks, device="cuda", dtype=torch.int32)[None]
    scale = dim**-0.5

    def row(query: torch.Tensor, context: int, width: int) -> torch.Tensor:
        layout = torch.cat([query, _randn(width - 1, heads, dim, seed=width).bfloat16()])
        meta = DecodeMetadata(
            block_tables=table,
            context_lens=torch.tensor([context], device="cuda", dtype=torch.int32),
            query_lens=torch.tensor([1], device="cuda", dtype=torch.int32),
            slot_mapping=torch.full((width,), -1, device="cuda", dtype=torch.int64),
            query_per_seq=width,
        )
        return paged_decode_attention_triton(layout, k_cache, v_cache, meta, scale)[0]

    for context in (16, 17, 32, 48, 100, 700):
        for seed in range(8):
            query = (_randn(1, heads, dim, seed=100 + seed) * channel).bfloat16()
            alone = row(query, context, 1)
            for width in (5, 16):
                assert torch.equal(row(query, context, width), alone), (context, seed, width)
