"""The GPU decode path: fused Triton kernels against their PyTorch twins, CUDA-graph replay
against the eager forward, and the engine on CUDA keeping its exactness guarantees."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import TINY_CONFIGS, compare_decode_path, make_hf_model, save_hf_model
from specdec.engine.llm import LLM
from specdec.models import fused, rms_norm
from specdec.models.attention import DecodeMetadata
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.gpu

DECODE_CONFIGS = [name for name in TINY_CONFIGS if name != "mistral_window"]
DECODE_CONFIGS += ["llama3", "yarn_mscale", "linear"]  # RoPE scaling (models_fixtures)


def _randn(*shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_fused_kernels_match_twins(dtype: torch.dtype, head_dim: int) -> None:
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    num_heads, num_kv_heads, num_tokens, dim = 8, 2, 12, 512
    x = _randn(num_tokens, dim, dtype=dtype, seed=1)
    residual = _randn(num_tokens, dim, dtype=dtype, seed=2)
    weight = 1 + 0.1 * _randn(dim, dtype=dtype, seed=3)
    for numerics in rms_norm.NUMERICS:  # Llama's, OLMo 2's and Gemma's numerics
        for res in (None, residual):
            want = fused.add_rms_norm_ref(x, res, weight, 1e-5, numerics)
            got = fused.add_rms_norm(
                x.cuda(), None if res is None else res.cuda(), weight.cuda(), 1e-5, numerics
            )
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(g.cpu(), w, **tol)
    # Qwen3's per-head q/k norm over a fused projection, in place (values untouched).
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=8)
    q_weight = 1 + 0.1 * _randn(head_dim, dtype=dtype, seed=9)
    k_weight = 1 + 0.1 * _randn(head_dim, dtype=dtype, seed=10)
    for numerics in rms_norm.NUMERICS:
        args = (q_weight, k_weight, 1e-6, numerics, num_heads, num_kv_heads)
        want = fused.qk_norm_ref(qkv, *args)
        got = fused.qk_norm(qkv.cuda(), *(a.cuda() if torch.is_tensor(a) else a for a in args))
        torch.testing.assert_close(got.cpu(), want, **tol)
        values = qkv[:, (num_heads + num_kv_heads) * head_dim :]
        assert torch.equal(got.cpu()[:, (num_heads + num_kv_heads) * head_dim :], values)
        # negative control: the query heads were normed with q_weight, not k_weight
        swapped = fused.qk_norm_ref(qkv, k_weight, q_weight, *args[2:])
        queries = slice(0, num_heads * head_dim)
        assert not torch.allclose(got.cpu()[:, queries], swapped[:, queries], **tol)
    gate_up = _randn(num_tokens, 2 * 1000, dtype=dtype, seed=4)
    torch.testing.assert_close(
        fused.silu_mul(gate_up.cuda()).cpu(), fused.silu_mul_ref(gate_up), **tol
    )
    # RoPE + cache write, then attention over scattered blocks with mixed query lengths.
    num_blocks, block_size, q_per_seq = 64, 16, 5
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=5)
    positions = torch.tensor([30, 31, 32, 33, 34, 0, 0, 0, 0, 0, 200, 201])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    slots = torch.tensor([30, 31, 32, 33, 34, -1, -1, -1, -1, -1, 520, 521])
    caches = {}
    for device in ("cpu", "cuda"):
        k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=6)
        v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=7)
        k_cache, v_cache = k_cache.to(device), v_cache.to(device)
        query = fused.rope_write_kv(
            qkv.to(device),
            positions.to(device),
            inv_freq.to(device),
            k_cache,
            v_cache,
            slots.to(device),
            num_heads,
            num_kv_heads,
        )
        caches[device] = (query, k_cache, v_cache)
    for want, got in zip(caches["cpu"], caches["cuda"], strict=True):
        torch.testing.assert_close(got.cpu(), want, **tol)
    # 3 sequences of Q=5 rows (the middle one inert) plus a 4th, longer one.
    query = _randn(4 * q_per_seq, num_heads, head_dim, dtype=dtype, seed=8)
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(9))[:40]
    meta = DecodeMetadata(
        block_tables=tables.view(4, 10).to(torch.int32),
        context_lens=torch.tensor([35, 0, 17, 160], dtype=torch.int32),
        query_lens=torch.tensor([5, 0, 2, 1], dtype=torch.int32),
        slot_mapping=torch.full((4 * q_per_seq,), -1),
        query_per_seq=q_per_seq,
    )
    _, k_cache, v_cache = caches["cpu"]
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta, head_dim**-0.5)
    cuda_meta = DecodeMetadata(
        meta.block_tables.cuda(),
        meta.context_lens.cuda(),
        meta.query_lens.cuda(),
        meta.slot_mapping.cuda(),
        q_per_seq,
    )
    got = fused.paged_decode_attention(
        query.cuda(), k_cache.cuda(), v_cache.cuda(), cuda_meta, head_dim**-0.5
    )
    torch.testing.assert_close(got.cpu(), want, **tol)
    assert (got[q_per_seq : 2 * q_per_seq] == 0).all()  # the inert sequence


@pytest.mark.parametrize("name", DECODE_CONFIGS)
@pytest.mark.parametrize("use_graphs", [False, True])
def test_decode_path_matches_eager_on_cuda(name: str, use_graphs: bool) -> None:
    runner, _ = compare_decode_path(name, "cuda", use_graphs=use_graphs, atol=1e-4)
    assert bool(runner.graphs.graphs) == use_graphs


VOCAB = 97
PROMPTS = [[5, 17, 3, 9, 11], [40, 2, 7, 7, 7, 7, 7, 7, 7], [60, 61, 62, 60, 61, 62, 60, 61], [9]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama-gpu"))


def _generate(model_dir, params, spec=None, **kwargs):
    args = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 256, **kwargs}
    args.update(device="cuda", dtype="float32")
    llm = LLM(str(model_dir), speculative_config=spec, **args)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def _speculation_keeps_its_guarantees(model_dir, spec) -> list[list[int]]:
    """Greedy speculation under CUDA graphs == greedy plain (drafts were proposed), and sampled
    speculation with graphs == with enforce_eager (K pinned: an adaptive K follows measured
    timings, which differ between the two); returns the sampled tokens."""
    spec = {**spec, "adaptive": False}
    plain_greedy, _ = _generate(model_dir, GREEDY)
    spec_greedy, llm = _generate(model_dir, GREEDY, spec)
    assert spec_greedy == plain_greedy
    rounds = llm.engine._rounds  # rounds on the device replay graphs of their own
    captured = rounds is not None and rounds.graph_cache.graphs
    assert llm.engine.runner.graphs is not None and (llm.engine.runner.graphs.graphs or captured)
    assert llm.get_metrics()["num_drafts"] > 0
    graphed, _ = _generate(model_dir, SAMPLED, spec)
    eager, _ = _generate(model_dir, SAMPLED, spec, enforce_eager=True)
    assert graphed == eager
    return graphed


@pytest.mark.parametrize("drafter", ["ngram", "truncated:1"])
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_engine_on_cuda_keeps_its_guarantees(model_dir, drafter, method) -> None:
    """CUDA graphs change nothing: greedy speculation == greedy plain; coupled sampling ==
    plain sampling; graphs == enforce_eager for the same seeds."""
    spec = {"num_speculative_tokens": 3, "rejection_sample_method": method}
    if drafter == "ngram":
        spec["method"] = "ngram"
    else:
        spec.update(method="draft_model", model=drafter)
    graphed = _speculation_keeps_its_guarantees(model_dir, spec)
    if method == "coupled":
        plain_sampled, _ = _generate(model_dir, SAMPLED)
        assert graphed == plain_sampled


@pytest.fixture(scope="module")
def trained_drafters(model_dir, tmp_path_factory):
    """eagle, dflash and dspark heads trained on the GPU by `specdec train-drafter --device cuda`
    (self-distillation through the CUDA engine, a few steps, the held-out evaluation)."""
    import json

    from models_fixtures import prompt_tokens
    from specdec.cli import main

    root = tmp_path_factory.mktemp("gpu-drafters")
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as file:
        for tokens in prompt_tokens(97, [6] * 12, seed=5):
            file.write(json.dumps({"prompt_token_ids": tokens}) + "\n")
    dirs = {}
    for kind, options in (
        ("eagle", ["ttt_steps=2"]),
        ("dflash", ["block_size=3"]),
        ("dspark", ["block_size=3", "markov_rank=8"]),
    ):
        out = root / kind
        args = ["train-drafter", "--target", str(model_dir), "--kind", kind]
        args += ["--data", str(prompts), "--out", str(out), "--device", "cuda"]
        args += ["--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--warmup-steps", "2"]
        args += ["--gen-max-tokens", "24", "--gen-repeats", "2", "--gen-batch", "16"]
        args += ["--holdout-fraction", "0.25", "--eval-prompts", "2", "--eval-max-tokens", "8"]
        args += ["--eval-k", "3"]
        for option in options:
            args += ["--option", option]
        assert main(args) == 0
        result = json.loads((out / "acceptance.json").read_text())
        assert result["steps"] == 6
        dirs[kind] = out
    return dirs


@pytest.mark.parametrize("kind", ["eagle", "dflash", "dspark"])
def test_target_reading_drafters_on_cuda(model_dir, trained_drafters, kind) -> None:
    """Drafters that read target features, trained on the GPU, run under CUDA graphs: greedy
    speculation == greedy plain, and graphs == enforce_eager for sampled standard verification."""
    spec = {"method": kind, "model": str(trained_drafters[kind]), "num_speculative_tokens": 3}
    _speculation_keeps_its_guarantees(model_dir, spec)
    if kind == "eagle":  # its draft steps were replayed from CUDA graphs (eagerly with
        # enforce_eager: the equality above covers both)
        _, llm = _generate(model_dir, SAMPLED, spec)
        graphs = llm.engine.drafter._graphs
        rounds = llm.engine._rounds  # rounds on the device replay the head inside their graphs
        in_rounds = rounds is not None and rounds.graph_cache.graphs
        assert graphs is not None and graphs.use_graphs and (graphs.graphs or in_rounds)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_async_scheduling_on_cuda_emits_the_same_tokens(model_dir, params) -> None:
    """Overlapped steps feed the previous step's samples to the graph on the device: the tokens
    equal the synchronous loop's, with graphs and eagerly."""
    plain, synchronous = _generate(model_dir, params, async_scheduling=False)
    assert not synchronous.engine.async_scheduling
    overlapped, llm = _generate(model_dir, params)  # "auto": on for CUDA
    assert llm.engine.async_scheduling
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    eager, _ = _generate(model_dir, params, async_scheduling=True, enforce_eager=True)
    assert overlapped == plain
    assert eager == plain
