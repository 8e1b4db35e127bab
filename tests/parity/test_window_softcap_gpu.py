"""Sliding windows, soft-capped scores and GeGLU on CUDA: the decode/verify kernels (single pass,
split-KV), the flash prefill kernel and the gelu_tanh * up kernel against their PyTorch twins on
the CPU, and tiny Mistral-with-window / Phi-3-window / Gemma 2 / Gemma 3 models on CUDA's decode
path (eager and CUDA-graphed) against the eager path and `transformers`.

Tolerances as tests/parity/test_long_attention_gpu.py states them (the twins run the kernels'
tiles in their order, not their tensor-core summation order nor the hardware exp2): float32
|diff| <= 1e-4, bfloat16 2e-2 + 2e-2 |x|; bits where the contract says bits (a context of one
partition: split-KV == single pass; a window no row reaches past == no window). Model logits
within 1e-4 of `transformers` (float32). A tree verify step's window counts from its nodes'
depths. Negative controls: the kernels run without the window or
the cap their twins apply, and a Gemma 2 without its cap, move off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from models_fixtures import (
    GREEDY_PROMPTS,
    compare_decode_path,
    decode_path_error,
    drop_attention_cap,
    hf_decode_logits,
    hf_greedy,
    hf_logits,
    llm_greedy,
    make_gemma2_hf_model,
    make_gemma3_hf_model,
    max_error,
    prompt_tokens,
    save_hf_model,
)
from specdec.engine.llm import LLM
from specdec.models import fused, load_model, prompt_logits, split_kv
from specdec.models.attention import AttentionMetadata, DecodeMetadata
from specdec.models.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
ATOL = 1e-4  # model logits against `transformers` (float32)
SCALE, CAP, PARTITION = 0.3, 2.0, 128
CONTEXTS = [1, 64, 127, 129, 300, 0]
CASES = [(1, None), (5, None), (17, None), (64, None), (130, None), (1000, None)]
CASES += [(None, CAP), (40, CAP)]


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _decode_case(q_per_seq: int, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    """CPU queries and caches (GQA 2:1, head_dim 64, blocks of 16 scattered) and `meta(parts,
    device)` over CONTEXTS, the 300-key sequence with 2 live rows (padding rows)."""
    block_size, head_dim, num_kv_heads, group = 16, 64, 2, 2
    num_seqs = len(CONTEXTS)
    query_lens = [min(q_per_seq, c) for c in CONTEXTS]
    query_lens[4] = min(2, q_per_seq)
    width = max(-(-c // block_size) for c in CONTEXTS) + 2
    num_blocks = num_seqs * width + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = order[: num_seqs * width].view(num_seqs, width).to(torch.int32)
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 1, dtype=dtype)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 2, dtype=dtype)
    query = _randn(num_seqs * q_per_seq, num_kv_heads * group, head_dim, seed=seed + 3, dtype=dtype)

    def meta(parts: int, device: str) -> DecodeMetadata:
        return DecodeMetadata(
            block_tables=tables.to(device),
            context_lens=torch.tensor(CONTEXTS, dtype=torch.int32, device=device),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.full((num_seqs * q_per_seq,), -1, device=device),
            query_per_seq=q_per_seq,
            num_partitions=parts,
        )

    return query, k_cache, v_cache, meta


@pytest.fixture
def small_partitions(monkeypatch: pytest.MonkeyPatch) -> int:
    from specdec.models import attention_tiles

    monkeypatch.setattr(attention_tiles, "SPLIT_KV_PARTITION", PARTITION)
    return PARTITION


def _parts() -> int:
    return -(-max(CONTEXTS) // PARTITION) + 1


@pytest.mark.parametrize("window,cap", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_per_seq", [1, 5])
def test_decode_kernels_match_twins(small_partitions, window, cap, dtype, q_per_seq) -> None:
    from specdec.models import fused_triton, split_kv_triton

    query, k_cache, v_cache, meta = _decode_case(q_per_seq, dtype, 3)
    options = dict(sliding_window=window, softcap=cap)
    cuda = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    single = fused_triton.paged_decode_attention_triton(*cuda, meta(0, "cuda"), SCALE, **options)
    twin = fused.paged_decode_attention_ref(
        query, k_cache, v_cache, meta(0, "cpu"), SCALE, **options
    )
    torch.testing.assert_close(single.cpu(), twin, **TOLERANCE[dtype])
    split = split_kv_triton.split_kv_decode_attention_triton(
        *cuda, meta(_parts(), "cuda"), SCALE, **options
    )
    split_twin = split_kv.split_kv_decode_attention_ref(
        query, k_cache, v_cache, meta(_parts(), "cpu"), SCALE, **options
    )
    torch.testing.assert_close(split.cpu(), split_twin, **TOLERANCE[dtype])
    for b in (0, 1, 2, 5):  # contexts of one partition: the single pass's bits
        rows = slice(b * q_per_seq, (b + 1) * q_per_seq)
        assert torch.equal(split[rows], single[rows]), f"sequence {b}"
    # The dispatch (as the layers call it) runs the same kernels.
    dispatched = fused.paged_decode_attention(*cuda, meta(0, "cuda"), SCALE, **options)
    assert torch.equal(dispatched, single)


def test_window_past_every_context_gives_the_full_bits(small_partitions) -> None:
    """SLIDING with a window no row reaches past (the DEVICE_BOUND loops skip no chunk, the
    masks agree): the full-attention launch's bits, single pass and split-KV."""
    from specdec.models import fused_triton, split_kv_triton

    query, k_cache, v_cache, meta = _decode_case(5, torch.bfloat16, 7)
    cuda = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    for launch, parts in (
        (fused_triton.paged_decode_attention_triton, 0),
        (split_kv_triton.split_kv_decode_attention_triton, _parts()),
    ):
        full = launch(*cuda, meta(parts, "cuda"), SCALE)
        wide = launch(*cuda, meta(parts, "cuda"), SCALE, sliding_window=max(CONTEXTS) + 5)
        assert torch.equal(wide, full)


def test_decode_kernels_negative_control(small_partitions) -> None:
    from specdec.models import fused_triton

    query, k_cache, v_cache, meta = _decode_case(5, torch.float32, 3)
    cuda = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    twin = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0, "cpu"), SCALE, 17, CAP)
    no_window = fused_triton.paged_decode_attention_triton(
        *cuda, meta(0, "cuda"), SCALE, softcap=CAP
    )
    no_cap = fused_triton.paged_decode_attention_triton(
        *cuda, meta(0, "cuda"), SCALE, sliding_window=17
    )
    assert (no_window.cpu()[20:25] - twin[20:25]).abs().max() > 1e-2  # the 300-key sequence
    assert (no_cap.cpu() - twin).abs().max() > 1e-2


@pytest.mark.parametrize("window,cap", [(4, None), (17, CAP), (130, None)])
def test_tree_step_kernels_window_from_depths(small_partitions, window, cap) -> None:
    """A tree verify step (4 nodes: root, two children, a grandchild) under a window counted
    from each node's position (its depth), single pass and split-KV, against the twins."""
    from specdec.models import fused_triton, split_kv_triton

    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()
    depths = torch.tensor([0, 1, 1, 2])
    masks = torch.stack([tree if c >= 4 else torch.ones(4, 4, dtype=torch.bool) for c in CONTEXTS])
    positions = torch.cat(
        [(c - 4 + depths) if c >= 4 else torch.arange(4) for c in CONTEXTS]
    )  # [B * 4]
    query, k_cache, v_cache, meta = _decode_case(4, torch.float32, 11)
    query_lens = torch.tensor([min(4, c) for c in CONTEXTS], dtype=torch.int32)
    cuda = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    for launch, twin, parts in (
        (fused_triton.paged_decode_attention_triton, fused.paged_decode_attention_ref, 0),
        (
            split_kv_triton.split_kv_decode_attention_triton,
            split_kv.split_kv_decode_attention_ref,
            _parts(),
        ),
    ):
        step = dataclasses.replace(meta(parts, "cpu"), query_lens=query_lens, tree_mask=masks)
        gpu = dataclasses.replace(
            meta(parts, "cuda"), query_lens=query_lens.cuda(), tree_mask=masks.cuda()
        )
        options = dict(sliding_window=window, softcap=cap)
        want = twin(query, k_cache, v_cache, step, SCALE, positions=positions, **options)
        got = launch(*cuda, gpu, SCALE, positions=positions.cuda(), **options)
        torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window,cap", [(None, CAP), (20, CAP)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_caps_as_its_twin(window, cap, dtype) -> None:
    query_lens, context_lens, block_size = [7, 70, 1], [7, 100, 30], 16
    tables = [[0], [1, 2, 3, 4, 5, 6, 7], [8, 9]]
    k_cache = _randn(10, block_size, 2, 64, seed=4, dtype=dtype)
    v_cache = _randn(10, block_size, 2, 64, seed=5, dtype=dtype)
    query = _randn(sum(query_lens), 4, 64, seed=6, dtype=dtype)
    options = dict(scale=SCALE, sliding_window=window, softcap=cap)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    twin = paged_prefill_attention_ref(
        query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, **options
    )
    gpu = AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cuda")
    got = paged_prefill_attention(
        query.cuda(),
        k_cache.cuda(),
        v_cache.cuda(),
        gpu.cu_seqlens_q,
        gpu.context_lens,
        gpu.block_tables,
        gpu.max_seqlen_q,
        **options,
    )
    torch.testing.assert_close(got.cpu(), twin, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_twin(dtype) -> None:
    gate_up = (3 * _randn(12, 2 * 1000, seed=8)).to(dtype)
    got = fused.gelu_tanh_mul(gate_up.cuda()).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, fused.gelu_tanh_mul_ref(gate_up), **TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["mistral_window", "phi3_window"])
@pytest.mark.parametrize("use_graphs", [False, True])
def test_window_models_decode_path_matches_eager(name: str, use_graphs: bool) -> None:
    """The runner's decode path (the kernels with the window; graphed or not) against its eager
    path (masked attention) on CUDA: logits, features and caches."""
    runner, _ = compare_decode_path(name, "cuda", use_graphs=use_graphs, atol=1e-4)
    assert bool(runner.graphs.graphs) == use_graphs


GEMMA_MODELS = {
    "gemma2": lambda: make_gemma2_hf_model("gemma2"),
    "gemma2_uncapped": lambda: make_gemma2_hf_model("gemma2_uncapped"),
    "gemma3": lambda: make_gemma3_hf_model("gemma3"),
}


@pytest.fixture(scope="module", params=list(GEMMA_MODELS))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf_model = GEMMA_MODELS[request.param]()
    return request.param, hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))


def test_gemma_on_cuda_matches_transformers(gemma: Any) -> None:
    """Prompts longer than the window (the flash prefill kernel with window and cap), then
    decode/verify steps of 1 to 4 rows on CUDA's decode path (the decode kernels, GeGLU's
    kernel) to position 40, within 1e-4 of `transformers`; negative control (capped models):
    the cap dropped moves the decode path off."""
    name, hf_model, path = gemma
    prompts = prompt_tokens(97, [1, 6, 29, 17], seed=2)
    model = load_model(path, device="cuda").model
    ours = [logits.cpu() for logits in prompt_logits(model, prompts, block_size=4)]
    assert max_error(ours, [hf_logits(hf_model, prompt) for prompt in prompts]) <= ATOL
    sequences = prompt_tokens(97, [40, 26, 33], seed=6)
    references = [hf_decode_logits(hf_model, seq) for seq in sequences]
    model = load_model(path, device="cuda").model
    assert model.model.eager_only_reason is None
    errors = decode_path_error(model, [r.cuda() for r in references], sequences)
    assert errors <= ATOL
    if name == "gemma2":
        capless = drop_attention_cap(load_model(path, device="cuda").model)
        assert decode_path_error(capless, [r.cuda() for r in references], sequences) > 1e-2


def test_gemma_greedy_generation_on_cuda(gemma: Any) -> None:
    """24 greedy tokens through `LLM` on CUDA (decode graphs) equal `generate`'s."""
    _, hf_model, path = gemma
    args = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 256}
    llm = LLM(str(path), speculative_config=None, device="cuda", dtype="float32", **args)
    outputs = llm_greedy(llm, GREEDY_PROMPTS)
    for prompt, output in zip(GREEDY_PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)
