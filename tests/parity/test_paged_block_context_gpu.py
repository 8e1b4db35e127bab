"""The block drafters' paged device context on the GPU: the split-KV kernels' LSE variant against
their PyTorch twin (paged layouts with holes, contexts 0, 1, block and partition boundaries, 5000,
131,072; block rows 5 and 9 a slot; GQA; float32 and bfloat16), the whole paged block attention
(context partial + own rows, merged by LSE) against naive softmax, its CUDA-graph replay with new
tables and lengths against eager, and DFlash / DSpark device rounds over contexts of several
partitions (graphed and eager) emitting the synchronous step's tokens, every pool block back.

Tolerances (as tests/parity/test_long_attention_gpu.py): the twin runs the kernels' 64-key steps
and partitions in their order but not their tensor-core summation order nor the hardware exp, so
outputs agree to float32 rounding (float32: |diff| <= 1e-4 + 1e-4 |x|) or to bfloat16 rounding
(bfloat16: 2e-2 + 2e-2 |x|); log-sum-exps likewise. A graph replay is the eager launch bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from block_drafter_fixtures import save_tiny_block_drafter
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from paged_block_fixtures import context_meta, naive_block_attention, paged_layout, randn
from specdec.drafters.block.paged_context import paged_block_attention
from specdec.engine.llm import LLM
from specdec.models import load_model, split_kv
from specdec.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
CONTEXTS = [0, 1, 16, 17, 2048, 2049, 5000, 3]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    got, want = got.float(), want.float()
    both_inf = torch.isneginf(got) & torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf rows differ"
    diff = torch.where(both_inf, 0.0, (got - want).abs())
    tol = TOLERANCE[dtype]
    bad = diff > tol["atol"] + tol["rtol"] * torch.where(both_inf, 0.0, want).abs()
    worst = int(diff.argmax()) if diff.numel() else 0
    assert not bad.any() and not torch.isnan(got).any(), (
        f"{what}: max |diff| {diff.max().item():.3e} at flat index {worst}; "
        f"{int(bad.sum())} of {diff.numel()} values past atol {tol['atol']} rtol {tol['rtol']}; "
        f"NaN in result: {bool(torch.isnan(got).any())}"
    )


def _case(contexts, rows, heads, dtype, seed):
    num_heads, num_kv_heads, head_dim = heads
    k_pool, v_pool, tables, lens = paged_layout(
        contexts, num_kv_heads, head_dim, seed, dtype=dtype, device="cuda"
    )
    n = len(contexts)
    query = randn(n, rows, num_heads, head_dim, seed=seed + 3, dtype=dtype, device="cuda")
    key = randn(n, rows, num_kv_heads, head_dim, seed=seed + 4, dtype=dtype, device="cuda")
    value = randn(n, rows, num_kv_heads, head_dim, seed=seed + 5, dtype=dtype, device="cuda")
    return query, key, value, k_pool, v_pool, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 9])
@pytest.mark.parametrize("heads", [(32, 8, 128), (4, 1, 64), (4, 4, 24)])
def test_lse_kernels_match_twin(dtype, rows, heads) -> None:
    query, _, _, k_pool, v_pool, tables, lens = _case(CONTEXTS, rows, heads, dtype, seed=41)
    parts = split_kv.num_partitions(12000)  # more than any context needs: empty partitions
    meta = context_meta(tables, lens, rows, parts)
    args = (query.flatten(0, 1), k_pool, v_pool, meta, heads[2] ** -0.5)
    got_out, got_lse = split_kv.split_kv_attention_lse(*args)
    want_out, want_lse = split_kv.split_kv_attention_lse_ref(*args)
    what = f"LSE split-KV rows {rows} heads {heads} {dtype}"
    _assert_close(got_out, want_out, f"{what}: out", dtype)
    _assert_close(got_lse, want_lse, f"{what}: lse", dtype)
    inert = slice(0, rows)  # context 0
    assert (got_out[inert] == 0).all() and torch.isneginf(got_lse[inert]).all(), what


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_block_attention_is_softmax_over_context_and_own_rows(dtype, softcap) -> None:
    """Also with Gemma 2's soft-capped scores (a cap of 0.5 binds on these scores)."""
    case = _case(CONTEXTS, 9, (32, 8, 128), dtype, seed=51)
    parts = split_kv.num_partitions(12000)
    got = paged_block_attention(*case, parts, 128**-0.5, softcap)
    want = naive_block_attention(*case, 128**-0.5, softcap)
    _assert_close(got, want, f"paged block attention {dtype} softcap {softcap}", dtype)


def test_lse_kernels_at_128k_context() -> None:
    """One slot of 131,072 context positions (Llama-3-8B heads, a DFlash block of 9 rows) and a
    short one: kernel == twin (int64 addressing of a large pool)."""
    contexts, rows = [131072, 7], 9
    query, _, _, k_pool, v_pool, tables, lens = _case(
        contexts, rows, (32, 8, 128), torch.bfloat16, seed=61
    )
    meta = context_meta(tables, lens, rows, split_kv.num_partitions(131072 + 9))
    args = (query.flatten(0, 1), k_pool, v_pool, meta, 128**-0.5)
    got_out, got_lse = split_kv.split_kv_attention_lse(*args)
    want_out, want_lse = split_kv.split_kv_attention_lse_ref(*args)
    _assert_close(got_out, want_out, "LSE split-KV at 128K: out", torch.bfloat16)
    _assert_close(got_lse, want_lse, "LSE split-KV at 128K: lse", torch.bfloat16)


def test_paged_block_attention_replays_in_a_cuda_graph() -> None:
    """Captured once over static inputs, replayed after the tables and lengths changed in place
    (another layout, other contexts): the eager result on the new inputs, bit for bit."""
    first = _case([40, 0, 300, 17], 5, (8, 2, 64), torch.bfloat16, seed=71)
    second = _case([3, 290, 0, 64], 5, (8, 2, 64), torch.bfloat16, seed=72)
    static = [t.clone() for t in first]
    parts = split_kv.num_partitions(2048)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_block_attention(*static, parts, 0.125)  # compiles the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_block_attention(*static, parts, 0.125)
    for inputs in (first, second):
        for tensor, value in zip(static, inputs, strict=True):
            tensor.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = paged_block_attention(*inputs, parts, 0.125)
        assert torch.equal(out, eager), f"replay differs by {(out - eager).abs().max().item()}"


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny Llama with a declared context of 4096 (room for prompts of several partitions)."""
    model = make_hf_model("llama")
    model.config.max_position_embeddings = 4096
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-long-paged"))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_device_rounds_over_long_paged_contexts_emit_the_synchronous_tokens(
    long_model_dir, tmp_path, kind, method
) -> None:
    target = load_model(long_model_dir).model
    extra = {}
    if kind == "dspark":
        extra = {"confidence_scale": 10.0, "confidence_bias": -0.5, "min_survival_probability": 0.3}
    drafter = save_tiny_block_drafter(
        tmp_path / kind, kind, target, block_size=4, noise=0.05, **extra
    )
    spec = {
        "method": kind,
        "model": str(drafter),
        "num_speculative_tokens": 3,
        "rejection_sample_method": method,
        "adaptive": False,
    }
    prompts = prompt_tokens(97, [2500, 40, 1100], seed=5)
    params = [
        SamplingParams(
            temperature=1.0, top_k=30, top_p=0.9, max_tokens=24, ignore_eos=True, seed=70 + i
        )
        for i in range(len(prompts))
    ]
    args = {"max_model_len": 4096, "block_size": 16, "num_kv_blocks": 512, "dtype": "float32"}
    results = {}
    for name, options in {
        "sync": {"async_scheduling": False},
        "graphed": {"async_scheduling": True},
        "eager": {"async_scheduling": True, "enforce_eager": True},
    }.items():
        llm = LLM(str(long_model_dir), speculative_config=spec, device="cuda", **args, **options)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outputs]
        if name != "sync":
            assert llm.get_metrics()["loop"]["num_device_rounds"] > 0, name
            paged = llm.engine.drafter.device_context
            assert paged is not None and paged.num_free_blocks == 512, name
    assert results["graphed"] == results["sync"]
    assert results["eager"] == results["sync"]
