"""Long-context attention on the GPU: the flash-style prefill kernel and the split-KV
decode/verify kernels against their PyTorch twins (paged layouts with holes, chunk boundaries,
K + 1 query rows, GQA, sliding windows, FP8 caches), the split-KV kernel's one-partition bits,
prefill memory linear in the context, FP8 cache writes, and the model runner's greedy output with
the new kernels (CUDA graphs replaying split-KV) against the old path.

Tolerances: the twins run the kernels' tiles in the kernels' order, but not their tensor-core
summation order nor the hardware exp2, so outputs agree to float32 rounding (float32 inputs:
|diff| <= 1e-4) or to bfloat16 output rounding (bfloat16: |diff| <= 2e-2 + 2e-2 |x|). Every
failure message prints the max difference and where it is.
"""

from __future__ import annotations

import pytest
import torch

from models_fixtures import seeded_model
from specdec.models import attention, fused, split_kv
from specdec.models.attention import AttentionMetadata, DecodeMetadata, to_cache_dtype
from specdec.models.attention_tiles import SPLIT_KV_PARTITION, decode_query_bucket
from specdec.models.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from specdec.runner.model_runner import PagedModelRunner, StepInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
FP8 = torch.float8_e4m3fn


def _randn(*shape, seed: int, dtype=torch.float32, device="cuda") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(device)


def _assert_close(
    got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype, tol: dict | None = None
) -> None:
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    worst = int(diff.argmax()) if diff.numel() else 0
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
    tol = tol or TOLERANCE[dtype]
    bad = diff > tol["atol"] + tol["rtol"] * want.abs()
    assert not bad.any() and not torch.isnan(got).any(), (
        f"{what}: max |diff| {diff.max().item():.3e} at {where} "
        f"(got {got.flatten()[worst].item():.5f}, want {want.flatten()[worst].item():.5f}); "
        f"{int(bad.sum())} of {diff.numel()} values past atol {tol['atol']} rtol {tol['rtol']}; "
        f"NaN in result: {bool(torch.isnan(got).any())}"
    )


def _paged(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, seed, cache=None):
    """Queries and caches whose block tables are random, non-contiguous choices (holes)."""
    block_size = 16
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 11
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for context_len in context_lens:
        count = -(-context_len // block_size)
        tables.append(order[used : used + count])
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _randn(*shape, seed=seed + 1, dtype=dtype)
    v_cache = _randn(*shape, seed=seed + 2, dtype=dtype)
    if cache is not None:
        k_cache, v_cache = to_cache_dtype(4 * k_cache, cache), to_cache_dtype(4 * v_cache, cache)
    query = _randn(sum(query_lens), num_heads, head_dim, seed=seed + 3, dtype=dtype)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cuda")
    return query, k_cache, v_cache, meta


PREFILL_CASES = {
    "whole prompts at tile edges": ([63, 64, 65, 128, 129], [63, 64, 65, 128, 129]),
    "chunks over cached prefixes": ([256, 129, 1], [5000, 700, 77]),
    "a decode row and an empty share": ([300, 1, 0], [300, 9000, 5]),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 64), (4, 1, 24)])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_kernel_matches_twin(case, dtype, heads, window) -> None:
    query_lens, context_lens = PREFILL_CASES[case]
    query, k_cache, v_cache, meta = _paged(query_lens, context_lens, *heads, dtype, seed=3)
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    scale = heads[2] ** -0.5
    got = paged_prefill_attention(*args, meta.max_seqlen_q, scale=scale, sliding_window=window)
    want = paged_prefill_attention_ref(*args, scale=scale, sliding_window=window)
    _assert_close(got, want, f"prefill {case} heads {heads} window {window}", dtype)


@pytest.mark.parametrize("window", [None, 100])
def test_prefill_kernel_reads_fp8_cache(window) -> None:
    """FP8 caches read as their values (scale 1.0): kernel == twin, and == the kernel over the
    same values held in bfloat16."""
    query_lens, context_lens = [200, 1, 64], [3000, 500, 64]
    query, k_cache, v_cache, meta = _paged(
        query_lens, context_lens, 8, 2, 128, torch.bfloat16, seed=5, cache=FP8
    )
    tables = (meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    kwargs = {"scale": 128**-0.5, "sliding_window": window}
    got = paged_prefill_attention(query, k_cache, v_cache, *tables, meta.max_seqlen_q, **kwargs)
    want = paged_prefill_attention_ref(query, k_cache, v_cache, *tables, **kwargs)
    _assert_close(got, want, f"prefill over an FP8 cache, window {window}", torch.bfloat16)
    wide_k, wide_v = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    same = paged_prefill_attention(query, wide_k, wide_v, *tables, meta.max_seqlen_q, **kwargs)
    _assert_close(got, same, "prefill FP8 cache vs its bfloat16 values", torch.bfloat16)


def test_prefill_of_long_chunks_has_linear_memory() -> None:
    """A 32K context prefilled in 8K chunks (Llama-3-8B attention heads): the last chunk matches
    the twin, and the kernel allocates nothing beyond its output (a score matrix would be
    8192 x 32768 x 32 heads x 4 bytes = 32 GiB)."""
    chunk, total = 8192, 32768
    query_lens, context_lens = [chunk], [total]
    query, k_cache, v_cache, meta = _paged(
        query_lens, context_lens, 32, 8, 128, torch.bfloat16, seed=9
    )
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = paged_prefill_attention(*args, chunk, scale=128**-0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    out_bytes = got.numel() * got.element_size()
    assert extra <= out_bytes + (8 << 20), (
        f"prefill of a {chunk}-token chunk over {total} keys allocated {extra / 2**20:.1f} MiB "
        f"beyond its inputs; its output is {out_bytes / 2**20:.1f} MiB"
    )
    # The twin over the last 512 queries of the chunk (the twin's cost grows with the rows).
    rows = 512
    cu = torch.tensor([0, rows], device="cuda")
    want = paged_prefill_attention_ref(
        query[-rows:], k_cache, v_cache, cu, meta.context_lens, meta.block_tables, scale=128**-0.5
    )
    _assert_close(got[-rows:], want, "prefill 8K chunk at 32K context", torch.bfloat16)


# ----------------------------------------------------------------------------- split-KV
# Partition edges follow the partition size (2,048 keys since s11).
_P = SPLIT_KV_PARTITION
CONTEXTS = [1, 63, 64, 65, _P - 1, _P, _P + 1, 3000, 0, 9000]


def _decode(contexts, q_per_seq, num_heads, num_kv_heads, head_dim, dtype, seed, cache=None):
    query_lens = [min(q_per_seq, c) for c in contexts]
    query_lens[3] = min(2, q_per_seq)  # fewer live rows than the layout's Q
    query, k_cache, v_cache, attn = _paged(
        [0] * len(contexts), contexts, num_heads, num_kv_heads, head_dim, dtype, seed, cache
    )
    query = _randn(len(contexts) * q_per_seq, num_heads, head_dim, seed=seed + 4, dtype=dtype)

    def meta(parts: int) -> DecodeMetadata:
        return DecodeMetadata(
            block_tables=attn.block_tables,
            context_lens=attn.context_lens,
            query_lens=torch.tensor(query_lens, device="cuda"),
            slot_mapping=torch.full((len(contexts) * q_per_seq,), -1, device="cuda"),
            query_per_seq=q_per_seq,
            num_partitions=parts,
        )

    return query, k_cache, v_cache, meta


# FP8 caches serve bfloat16 models only: no float32 x FP8 case.
@pytest.mark.parametrize(
    ("dtype", "cache"), [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, FP8)]
)
@pytest.mark.parametrize("q_per_seq", [1, 5])
@pytest.mark.parametrize("heads", [(32, 8, 128), (4, 1, 64), (4, 4, 24)])
def test_split_kv_kernels_match_twin(dtype, q_per_seq, heads, cache) -> None:
    query, k_cache, v_cache, meta = _decode(CONTEXTS, q_per_seq, *heads, dtype, 21, cache)
    parts = split_kv.num_partitions(12000)  # more than any context needs: empty partitions
    scale = heads[2] ** -0.5
    got = fused.paged_decode_attention(query, k_cache, v_cache, meta(parts), scale)
    want = split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, meta(parts), scale)
    what = f"split-KV Q={q_per_seq} heads {heads} cache {cache}"
    _assert_close(got, want, what, dtype)
    inert = slice(8 * q_per_seq, 9 * q_per_seq)
    assert (got[inert] == 0).all(), f"{what}: the inert sequence's rows are not 0"
    exact = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0), scale)
    _assert_close(got, exact, f"{what} vs exact softmax", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])  # SmolLM2's; Llama-3-8B's
def test_padding_to_the_query_bucket_keeps_each_rows_bits(dtype, heads) -> None:
    """Widths laid out at their bucket (`decode_query_bucket`, as the EAGLE head's eager
    catch-up pads) give each live row the bits of its own width, single-pass and split-KV alike
    (the tile is the same; only Q_PER_SEQ, a constexpr, changes). A few widths per tile: each
    width compiles variants of its own."""
    from dataclasses import replace

    num_heads, num_kv_heads, head_dim = heads
    group, num_seqs = num_heads // num_kv_heads, len(CONTEXTS)
    parts = split_kv.num_partitions(12000)
    scale = head_dim**-0.5
    for width in (1, 3, 6, 11):
        bucket = decode_query_bucket(width, group, 16)
        assert bucket > width
        query, k_cache, v_cache, meta = _decode(CONTEXTS, width, *heads, dtype, 29)
        padded = _randn(num_seqs, bucket, num_heads, head_dim, seed=31, dtype=dtype)
        padded[:, :width] = query.view(num_seqs, width, num_heads, head_dim)
        padded = padded.flatten(0, 1)
        slots = torch.full((num_seqs * bucket,), -1, device="cuda")
        for split in (0, parts):
            want = fused.paged_decode_attention(query, k_cache, v_cache, meta(split), scale)
            wide = replace(meta(split), query_per_seq=bucket, slot_mapping=slots)
            got = fused.paged_decode_attention(padded, k_cache, v_cache, wide, scale)
            got = got.view(num_seqs, bucket, num_heads, head_dim)[:, :width].flatten(0, 1)
            diff = (got.float() - want.float()).abs().max().item()
            assert torch.equal(got, want), (
                f"width {width} padded to {bucket} (heads {heads}, {dtype}, partitions "
                f"{split}): live rows differ by up to {diff:.3e}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_per_seq", [1, 5])
def test_split_kv_gives_single_pass_bits(dtype, q_per_seq) -> None:
    """Split-KV == the single-pass kernel bit for bit at every context, one partition or several
    (the single pass merges at the same edges since s33), so whichever kernel a step takes
    (a batch's longest context, device rounds or a host step) never changes a request's tokens."""
    query, k_cache, v_cache, meta = _decode(CONTEXTS, q_per_seq, 32, 8, 128, dtype, 23)
    split = fused.paged_decode_attention(query, k_cache, v_cache, meta(12), 128**-0.5)
    single = fused.paged_decode_attention(query, k_cache, v_cache, meta(0), 128**-0.5)
    for b, context_len in enumerate(CONTEXTS):
        rows = slice(b * q_per_seq, (b + 1) * q_per_seq)
        diff = (split[rows].float() - single[rows].float()).abs().max().item()
        assert torch.equal(split[rows], single[rows]), (
            f"context {context_len}: split-KV differs from the single-pass kernel by up to "
            f"{diff:.3e} (the batch-invariance argument in models/split_kv.py fails)"
        )


def test_split_kv_at_128k_context() -> None:
    """One sequence of 131,072 keys (Llama-3-8B heads), decode and verify rows: kernel == twin
    (int64 addressing past 2^31 elements of the cache)."""
    contexts = [131072]
    for q_per_seq in (1, 5):
        query_lens = [q_per_seq]
        query, k_cache, v_cache, attn = _paged([0], contexts, 32, 8, 128, torch.bfloat16, seed=31)
        query = _randn(q_per_seq, 32, 128, seed=32, dtype=torch.bfloat16)
        meta = DecodeMetadata(
            attn.block_tables,
            attn.context_lens,
            torch.tensor(query_lens, device="cuda"),
            torch.full((q_per_seq,), -1, device="cuda"),
            q_per_seq,
            num_partitions=split_kv.num_partitions(131072),
        )
        got = fused.paged_decode_attention(query, k_cache, v_cache, meta, 128**-0.5)
        want = split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, meta, 128**-0.5)
        _assert_close(got, want, f"split-KV at 128K, Q={q_per_seq}", torch.bfloat16)


# ----------------------------------------------------------------------------- FP8 writes
def test_fp8_cache_writes_match_twin() -> None:
    """RoPE + K/V write into FP8 caches: the Triton write == the twin's, byte for byte (values
    past +-448 saturate in both)."""
    num_heads, num_kv_heads, head_dim, num_tokens = 8, 2, 128, 40
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=41, device="cpu")
    qkv = (qkv * 150).to(torch.bfloat16)  # some values past 448
    positions = torch.arange(num_tokens) * 97
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    slots = torch.randperm(200, generator=torch.Generator().manual_seed(42))[:num_tokens]
    slots[3] = -1
    results = {}
    for device in ("cpu", "cuda"):
        k_cache = torch.zeros(20, 16, num_kv_heads, head_dim, dtype=FP8, device=device)
        v_cache = torch.zeros_like(k_cache)
        args = (qkv, positions, inv_freq, k_cache, v_cache, slots)
        args = tuple(a.to(device) for a in args)
        query = (fused.rope_write_kv if device == "cuda" else fused.rope_write_kv_ref)(
            *args, num_heads, num_kv_heads
        )
        results[device] = (query.cpu(), k_cache.cpu(), v_cache.cpu())
    (_, k_want, v_want), (_, k_got, v_got) = results["cpu"], results["cuda"]
    for name, got, want in (("values", v_got, v_want), ("keys", k_got, k_want)):
        bits_got, bits_want = got.view(torch.uint8), want.view(torch.uint8)
        differ = int((bits_got != bits_want).sum())
        if name == "values":  # no RoPE: the same bf16 inputs, so the same bytes
            assert differ == 0, f"FP8 {name}: {differ} bytes differ between Triton and the twin"
        else:  # RoPE's cos/sin may differ by an ulp: a few keys one FP8 step apart
            diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)
            assert diff.max() <= 0.13, f"FP8 {name}: relative diff up to {diff.max():.3f}"
    assert v_got.float().abs().max() == 448.0, "saturation at 448 missing"


# ------------------------------------------------------------------ runner-level greedy
def _greedy(runner, prompt, blocks, steps, chunk):
    """Prefill in chunks (the eager path), then `steps` greedy decode steps (the decode path)
    and one 5-token verify step; returns (tokens, the logits each token was chosen from, verify
    logits)."""
    start = 0
    while start < len(prompt):
        piece = prompt[start : start + chunk]
        logits = runner.run([StepInput(piece, start, blocks, 1)])[0]
        start += len(piece)
    tokens, choice_logits = [], []
    for _ in range(steps):
        choice_logits.append(logits[-1].clone())
        token = int(logits[-1].argmax())
        tokens.append(token)
        logits = runner.run([StepInput([token], start, blocks, 1)])[0]
        start += 1
    verify = runner.run([StepInput(tokens[:5], start, blocks, 5)])[0].clone()
    return tokens, choice_logits, verify


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_greedy_matches_the_old_path(monkeypatch, dtype) -> None:
    """A 2,500-token prompt (prefill chunks of 1,000 through the flash kernel; decode and verify
    through split-KV replayed from CUDA graphs) gives the old path's greedy tokens (masked SDPA
    prefill, single-pass decode), except at near-ties (top-2 logit gap < 1e-2 for float32,
    0.15 for bfloat16, where the old path's own rounding decides)."""
    max_len, block_size = 4096, 16
    prompt = torch.randint(0, 97, (2500,), generator=torch.Generator().manual_seed(51)).tolist()
    num_blocks = max_len // block_size + 8
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(52)).tolist()
    blocks = blocks[: max_len // block_size]
    runs = {}
    for path in ("old", "new"):
        monkeypatch.setattr(attention, "FLASH_PREFILL_ON_CUDA", path == "new")
        model = seeded_model("llama", "cuda", dtype, max_position_embeddings=max_len)
        runner = PagedModelRunner(
            model,
            num_blocks,
            block_size,
            max_num_seqs=2,
            max_model_len=max_len,
            max_query_len=5,
            decode_path=True,
        )
        if path == "old":
            runner.graphs.num_partitions = 0
        runs[path] = _greedy(runner, prompt, blocks, 24, 1000)
        if path == "new":
            keys = list(runner.graphs.graphs)
            assert runner.graphs.num_partitions == split_kv.num_partitions(max_len)
            assert any(key[-1] for key in keys), f"no split-KV graph was captured: {keys}"
    old_tokens, old_logits, old_verify = runs["old"]
    new_tokens, _, new_verify = runs["new"]
    gap = 1e-2 if dtype == torch.float32 else 0.15
    for i, (old, new) in enumerate(zip(old_tokens, new_tokens, strict=True)):
        if old != new:
            top2 = old_logits[i].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < gap, (
                f"greedy token {i}: old path {old}, new {new}, old top-2 gap {margin:.4f}"
            )
            return  # after a near-tie the two continuations differ legitimately
    # Logits through 3 layers: bfloat16 attention outputs differ by their rounding, amplified.
    tol = None if dtype == torch.float32 else {"atol": 0.15, "rtol": 0.05}
    _assert_close(new_verify, old_verify, "verify logits at 2,524 tokens", dtype, tol)


def test_graphs_replay_split_kv_like_eager() -> None:
    """The split-KV decode and verify steps replayed from CUDA graphs == the same steps run
    eagerly, at contexts of three partitions (the graphs' grid covers max_model_len)."""
    max_len, block_size = 4096, 16
    outputs = {}
    for graphs in (False, True):
        model = seeded_model("llama", "cuda", torch.float32, max_position_embeddings=max_len)
        runner = PagedModelRunner(
            model,
            max_len // block_size,
            block_size,
            max_num_seqs=2,
            max_model_len=max_len,
            max_query_len=5,
            decode_path=True,
            enforce_eager=not graphs,
        )
        blocks = list(range(max_len // block_size))[::-1]  # descending: never contiguous
        prompt = torch.randint(0, 97, (3000,), generator=torch.Generator().manual_seed(61))
        runner.run([StepInput(prompt.tolist(), 0, blocks, 1)])
        rows = []
        for start, tokens in ((3000, [5]), (3001, [6, 7, 8, 9, 10]), (3006, [11])):
            rows.append(runner.run([StepInput(tokens, start, blocks, len(tokens))])[0].clone())
        outputs[graphs] = rows
        if graphs:
            assert any(key[-1] for key in runner.graphs.graphs), runner.graphs.graphs.keys()
    for i, (eager, graphed) in enumerate(zip(outputs[False], outputs[True], strict=True)):
        _assert_close(graphed, eager, f"graph replay step {i}", torch.float32)


def test_engine_with_fp8_cache(tmp_path) -> None:
    """LLM(kv_cache_dtype="fp8"): an FP8 cache with twice the blocks of bfloat16 in the same
    memory budget, CUDA graphs on, valid greedy tokens; the greedy agreement with bfloat16 is
    printed (drift is measured, not asserted: a random tiny model has many near-ties)."""
    import gc

    from models_fixtures import make_hf_model, save_hf_model
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    model_dir = save_hf_model(make_hf_model("llama"), tmp_path / "tiny-llama")
    prompts = [[5, 17, 3, 9, 11], [40, 2, 7, 7, 7, 7, 7, 7, 7], [60, 61, 62, 60, 61, 62], [9]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens, blocks = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=0.2,
            max_model_len=256,
        )
        cache = llm.engine.runner.kv_cache.k_cache
        assert cache.dtype == (FP8 if kv_cache_dtype == "fp8" else torch.bfloat16)
        blocks[kv_cache_dtype] = llm.engine.allocator.num_blocks
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[kv_cache_dtype] = [list(o.outputs[0].token_ids) for o in outputs]
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
        del llm, cache, outputs
        gc.collect()
        torch.cuda.empty_cache()
    ratio = blocks["fp8"] / blocks["auto"]
    assert 1.9 < ratio < 2.1, f"FP8 cache blocks {blocks['fp8']} vs bfloat16 {blocks['auto']}"
    for row in tokens["fp8"]:
        assert len(row) == 32 and all(0 <= t < 97 for t in row), row
    same = sum(
        a == b
        for x, y in zip(tokens["auto"], tokens["fp8"], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    print(f"FP8 vs bfloat16 KV cache: {same} of {32 * len(prompts)} greedy tokens agree")
