"""The grouped mixture-of-experts kernel on CUDA (`moe_triton.grouped_linear_triton`, CUDA's
default; SPECDEC_MOE_GROUPED_KERNEL=0 switches it off): against its twin
`moe.grouped_linear_ref`, a token alone == in any batch bit for bit, a CUDA-graph replay == the
eager call, and tiny Mixtral / Qwen3-MoE checkpoints on CUDA (eager, decode-path steps, the
engine under CUDA graphs, n-gram speculation) against `transformers` on the CPU.

Against the twin the kernel is compared within rounding, not bits: the GPU's dot sums each K
step in its own order (a float32 FMA chain started from the accumulator, bfloat16 tensor
cores), where the twin reproduces the interpreter's (tests/unit/models/test_moe_triton.py
checks those bits). Written on a machine without a GPU: unrun until a session with CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from models_fixtures import (
    GREEDY_PROMPTS,
    MOE_CONFIGS,
    NGRAM_PROMPTS,
    NGRAM_SPEC,
    decode_path_error,
    hf_greedy,
    hf_logits,
    llm_greedy,
    make_moe_hf_model,
    max_error,
    prompt_tokens,
    save_hf_model,
    speculative_equals_plain,
)
from specdec.models import moe
from specdec.models.moe import (
    GROUPED_BLOCK_K,
    GROUPED_KERNEL_ENV,
    grouped_experts,
    grouped_linear_ref,
    route,
)
from specdec.models.moe_tiles import expert_tiles

pytestmark = pytest.mark.gpu

ATOL = 1e-4  # float32 logits against transformers (test_families_moe's tolerance)
# (tokens, experts, hidden D, expert width F): the unit tests' small shapes and one of many K
# steps (a Mixtral-like width ratio).
SHAPES = [(20, 4, 32, 64), (20, 8, 64, 96), (64, 8, 1024, 1536)]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """test_decode_gpu's tolerances for a kernel against its twin."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 2e-2, "rtol": 2e-2}


def _inputs(
    num_tokens: int, num_experts: int, hidden: int, width: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """(x [T, D], gate_up [E, 2F, D], down [E, D, F], weights, experts [T, k=2]) on the CPU;
    expert 0 favoured so that it spans several tiles."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    scale = hidden**-0.5
    gate_up = (scale * torch.randn(num_experts, 2 * width, hidden, generator=generator)).to(dtype)
    down = (width**-0.5 * torch.randn(num_experts, hidden, width, generator=generator)).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, 0] += 2.0
    weights, experts = route(logits, 2, renormalize=True)
    return x, gate_up, down, weights, experts


def _kernel() -> moe.GroupedLinear:
    from specdec.models import moe_triton

    return moe_triton.grouped_linear_triton


def _cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.cuda() for tensor in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_kernel_matches_the_twin(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Gate/up, down and the whole grouped MLP on CUDA against the twin on the CPU."""
    x, gate_up, down, weights, experts = _inputs(*shape, dtype, seed=1)
    num_pairs = experts.numel()
    tiles = expert_tiles(experts, gate_up.shape[0])
    want = grouped_linear_ref(
        x, gate_up, tiles, tiles.token, tiles.position, num_pairs, GROUPED_BLOCK_K
    )
    cuda_tiles = expert_tiles(experts.cuda(), gate_up.shape[0])
    assert torch.equal(cuda_tiles.pair.cpu(), tiles.pair)
    assert torch.equal(cuda_tiles.tile_start.cpu(), tiles.tile_start)
    assert torch.equal(cuda_tiles.tile_end.cpu(), tiles.tile_end)
    got = _kernel()(
        x.cuda(),
        gate_up.cuda(),
        cuda_tiles,
        cuda_tiles.token,
        cuda_tiles.position,
        num_pairs,
        GROUPED_BLOCK_K,
    )
    torch.testing.assert_close(got.cpu(), want, **_tolerance(dtype))
    want = grouped_experts(x, gate_up, down, weights, experts, grouped_linear_ref)
    got = grouped_experts(*_cuda(x, gate_up, down, weights, experts))  # the dispatch: the kernel
    torch.testing.assert_close(got.cpu(), want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_token_alone_equals_token_in_any_batch_on_cuda(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """Each token alone == in every prefix batch and in the reversed batch, bit for bit."""
    x, gate_up, down, weights, experts = _cuda(*_inputs(*shape, dtype, seed=2))
    num_tokens = x.shape[0]

    def run(rows: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x[rows], gate_up, down, weights[rows], experts[rows])

    alone = torch.cat([run(torch.tensor([i], device="cuda")) for i in range(num_tokens)])
    for count in range(1, num_tokens + 1):
        assert torch.equal(run(torch.arange(count, device="cuda")), alone[:count]), count
    reverse = torch.arange(num_tokens, device="cuda").flip(0)
    assert torch.equal(run(reverse).flip(0), alone)


def test_grouped_mlp_replays_in_a_cuda_graph() -> None:
    """Captured once (the layout built on the device: no host sync), replayed on other inputs
    and other routes of as many tokens: the eager call's bits."""
    x, gate_up, down, weights, experts = _cuda(*_inputs(*SHAPES[1], torch.bfloat16, seed=3))
    static = [x.clone(), weights.clone(), experts.clone()]
    grouped_experts(static[0], gate_up, down, static[1], static[2])  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_experts(static[0], gate_up, down, static[1], static[2])
    for seed in (4, 5):
        new_x, _, _, new_weights, new_experts = _cuda(*_inputs(*SHAPES[1], torch.bfloat16, seed))
        for buffer, value in zip(static, (new_x, new_weights, new_experts), strict=True):
            buffer.copy_(value)
        graph.replay()
        want = grouped_experts(new_x, gate_up, down, new_weights, new_experts)
        assert torch.equal(out, want)


# --------------------------------------------------------------------------- bookkeeping
ROUTING_CASES = [(8, 2, True), (128, 8, True), (128, 8, False), (60, 6, True)]


@pytest.mark.parametrize("routing", ROUTING_CASES)
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 256, 1000])
def test_routing_kernels_match_their_twins_on_cuda(
    routing: tuple[int, int, bool], num_tokens: int
) -> None:
    """The routes, the layout (up to its largest tier; the twin's torch operations past it)
    and the combination (float32 and bfloat16): each kernel against its twin run on the same
    CUDA tensors, bit for bit; each negative control of the unit tests is seen."""
    from moe_routing_fixtures import (
        combined_worst_first,
        same_tiles,
        skewed_experts,
        tied_probs,
        ties_to_the_higher_id,
        unstable_tiles,
    )
    from specdec.models import moe_routing_triton as kernels
    from specdec.models.moe import combine_ranks_ref, step_tiles, top_k_routes_ref

    num_experts, top_k, renormalize = routing
    probs = tied_probs(num_tokens, num_experts, seed=num_tokens).cuda()
    weights, experts = kernels.top_k_routes_triton(probs, top_k, renormalize)
    want_weights, want_experts = top_k_routes_ref(probs, top_k, renormalize)
    assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)
    assert not torch.equal(experts, ties_to_the_higher_id(probs, top_k, renormalize)[1])
    for routes in (skewed_experts(num_tokens, num_experts, top_k, seed=1).cuda(), experts):
        assert same_tiles(step_tiles(routes, num_experts), expert_tiles(routes, num_experts))
        if routes.reshape(-1).bincount().max() > 1:
            assert not same_tiles(
                step_tiles(routes, num_experts), unstable_tiles(routes, num_experts)
            )
    generator = torch.Generator().manual_seed(num_tokens)
    for dtype in (torch.float32, torch.bfloat16):
        outputs = torch.randn(num_tokens * top_k, 2048, generator=generator).to(dtype).cuda()
        got = kernels.combine_ranks_triton(outputs, weights, dtype)
        assert torch.equal(got, combine_ranks_ref(outputs, weights, dtype))
        if dtype == torch.float32 and top_k > 2:
            assert not torch.equal(got, combined_worst_first(outputs, weights, dtype))


def test_router_logits_from_16_bit_values_in_float32() -> None:
    """The router's product on CUDA for a bfloat16 model (`batch_invariant_linear` with
    out_dtype float32): float32 sums of the 16-bit values on tensor cores, stored unrounded
    (close to the widened product; not the bfloat16-rounded one); every row alone == in any
    batch bit for bit."""
    from specdec.models.linear import batch_invariant_linear

    generator = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(64, 2048, device="cuda", generator=generator).bfloat16()
    weight = (0.02 * torch.randn(128, 2048, device="cuda", generator=generator)).bfloat16()
    got = batch_invariant_linear(x, weight, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    want = x.float() @ weight.float().t()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert not torch.equal(got, batch_invariant_linear(x, weight).float())
    alone = torch.cat(
        [batch_invariant_linear(x[i : i + 1], weight, out_dtype=torch.float32) for i in range(64)]
    )
    assert torch.equal(alone, got)
    for count in (2, 7, 16, 17, 33):
        assert torch.equal(
            batch_invariant_linear(x[:count], weight, out_dtype=torch.float32), got[:count]
        )


def test_routing_kernels_replay_in_a_cuda_graph() -> None:
    """Routes, layout and combination captured once and replayed on new probabilities: the
    eager calls' bits (nothing read back to the host)."""
    from specdec.models.moe import combine_ranks, step_tiles, top_k_routes

    generator = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(64, 128, generator=generator), dim=-1).cuda()
    outputs = torch.randn(64 * 8, 2048, generator=generator).to(torch.bfloat16).cuda()

    def step() -> tuple[torch.Tensor, ...]:
        weights, experts = top_k_routes(probs, 8, True)
        tiles = step_tiles(experts, 128)
        return (
            weights,
            experts,
            tiles.pair,
            tiles.tile_start,
            combine_ranks(outputs, weights, torch.bfloat16),
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (8, 9):
        fresh = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))
        probs.copy_(torch.softmax(fresh, dim=-1).cuda())
        graph.replay()
        for got, want in zip(captured, step(), strict=True):
            assert torch.equal(got, want)


# --------------------------------------------------------------------------- models
@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, checkpoint directory) per tiny MoE config."""
    pytest.importorskip("transformers", reason="the forward reference")
    hf_model = make_moe_hf_model(request.param)
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def grouped_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GROUPED_KERNEL_ENV, "1")


def test_moe_model_logits_on_cuda(family: Any, grouped_on: None) -> None:
    """Prompt logits (one batched prefill) and decode-path steps of 1-4 rows on CUDA through
    the grouped kernel, against `transformers` on the CPU; each prompt alone == in the batch
    bit for bit."""
    from specdec.models import load_model, prompt_logits

    hf_model, path = family
    model = load_model(path, device="cuda").model
    prompts = prompt_tokens(97, [1, 6, 29, 17], seed=2)
    batched = prompt_logits(model, prompts, block_size=4)
    references = [hf_logits(hf_model, prompt) for prompt in prompts]
    assert max_error([logits.cpu() for logits in batched], references) <= ATOL
    for prompt, in_batch in zip(prompts, batched, strict=True):
        assert torch.equal(prompt_logits(model, [prompt], block_size=4)[0], in_batch)
    sequences = prompt_tokens(97, [30, 19, 25], seed=6)
    references = [hf_logits(hf_model, seq).cuda() for seq in sequences]
    assert decode_path_error(model, references, sequences) <= ATOL


def test_moe_engine_on_cuda_greedy_and_speculative(family: Any, grouped_on: None) -> None:
    """The engine on CUDA takes the decode path (CUDA graphs) for the MoE model: greedy
    tokens == `generate`'s, and n-gram speculation == plain greedy."""
    from specdec.engine.llm import LLM

    hf_model, path = family
    args = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 256}
    llm = LLM(str(path), speculative_config=None, device="cuda", dtype="float32", **args)
    assert llm.engine.runner.graphs is not None
    outputs = llm_greedy(llm, GREEDY_PROMPTS)
    assert llm.engine.runner.graphs.graphs, "no CUDA graph was captured"
    for prompt, output in zip(GREEDY_PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)
    spec = LLM(str(path), speculative_config=NGRAM_SPEC, device="cuda", dtype="float32", **args)
    speculative_equals_plain(spec, NGRAM_PROMPTS)


def test_moe_engine_on_cuda_without_the_switch_runs_eagerly(
    family: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Switch off (SPECDEC_MOE_GROUPED_KERNEL=0): no decode path, the CPU's loop on CUDA,
    `generate`'s tokens."""
    from specdec.engine.llm import LLM

    monkeypatch.setenv(GROUPED_KERNEL_ENV, "0")
    hf_model, path = family
    args = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 256}
    llm = LLM(str(path), speculative_config=None, device="cuda", dtype="float32", **args)
    assert llm.engine.runner.graphs is None
    prompt = GREEDY_PROMPTS[0]
    output = llm_greedy(llm, [prompt])[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)
