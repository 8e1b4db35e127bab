"""The mixture-of-experts bookkeeping kernels (`moe_routing_triton`: a step's top-k routes, its
grouped layout, each token's combination of its experts' outputs) against their twins
(`moe.top_k_routes_ref`, `moe_tiles.expert_tiles`, `moe.combine_ranks_ref`) bit for bit under
Triton's CPU interpreter (tests marked `interpret`: skipped unless TRITON_INTERPRET=1 and
Triton is importable; tests/parity/test_moe_gpu.py runs them on a GPU), and compiled for sm_90
without a GPU (Triton's bundled ptxas). The twins' rules are checked on their own: ties go to
the lower expert id, the renormaliser is summed rank by rank from the best. Negative controls,
each of which the same bit-for-bit check must reject: ties to the higher id, a layout unstable
within an expert, the ranks combined worst first, the renormaliser summed worst first.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

from moe_routing_fixtures import (
    combined_worst_first,
    renormalized_worst_first,
    same_tiles,
    skewed_experts,
    tied_probs,
    ties_to_the_higher_id,
    unstable_tiles,
)
from specdec.models import moe
from specdec.models.moe import combine_ranks_ref, top_k_routes_ref
from specdec.models.moe_tiles import GROUPED_BLOCK_M, expert_tiles, max_tiles

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
# (experts E, top k, renormalize): Mixtral's 8 / 2, Qwen3-MoE's 128 / 8 with and without
# `norm_topk_prob`, and E and k that are not powers of two.
ROUTINGS = [(8, 2, True), (128, 8, True), (128, 8, False), (60, 6, True)]
TOKEN_COUNTS = [1, 5, 64, 300]


# --------------------------------------------------------------------------- the twins' rules
def test_twin_breaks_ties_to_the_lower_id_and_sums_best_first() -> None:
    probs = tied_probs(4, 8, seed=1)
    weights, experts = top_k_routes_ref(probs, 4, renormalize=True)
    assert experts[:, :2].tolist() == [[3, 5]] * 4
    kept = probs.gather(1, experts)
    total = kept[:, 0] + kept[:, 1] + kept[:, 2] + kept[:, 3]
    assert torch.equal(weights, kept / total[:, None])
    raw, _ = top_k_routes_ref(probs, 4, renormalize=False)
    assert torch.equal(raw, kept)


def test_the_checks_see_each_negative_control() -> None:
    """Each broken rule gives other bits on inputs the kernel tests use."""
    probs = tied_probs(64, 128, seed=2)
    want = top_k_routes_ref(probs, 8, renormalize=True)
    assert not torch.equal(ties_to_the_higher_id(probs, 8, True)[1], want[1])
    assert not torch.equal(renormalized_worst_first(probs, 8, True)[0], want[0])
    experts = skewed_experts(64, 128, 8, seed=3)
    assert not same_tiles(unstable_tiles(experts, 128), expert_tiles(experts, 128))
    outputs = torch.randn(64 * 8, 96, generator=torch.Generator().manual_seed(4))
    combined = combine_ranks_ref(outputs, want[0], torch.float32)
    assert not torch.equal(combined_worst_first(outputs, want[0], torch.float32), combined)


def test_route_is_softmax_then_the_top_k() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 16, generator=generator)
    weights, experts = moe.route(logits, 3, renormalize=True)
    want = top_k_routes_ref(torch.softmax(logits, dim=-1), 3, renormalize=True)
    assert torch.equal(weights, want[0]) and torch.equal(experts, want[1])


# --------------------------------------------------------------------------- the kernels
def _kernels() -> object:
    from specdec.models import moe_routing_triton

    return moe_routing_triton


RouteFn = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


@interpret
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_route_kernel_equals_twin(routing: tuple[int, int, bool], num_tokens: int) -> None:
    num_experts, top_k, renormalize = routing
    probs = tied_probs(num_tokens, num_experts, seed=num_tokens)
    weights, experts = _kernels().top_k_routes_triton(probs, top_k, renormalize)
    want_weights, want_experts = top_k_routes_ref(probs, top_k, renormalize)
    assert torch.equal(experts, want_experts)
    assert torch.equal(weights, want_weights)
    # Every token has a tie at rank 0 (the renormaliser's order: `test_the_checks_see_...`).
    assert not torch.equal(experts, ties_to_the_higher_id(probs, top_k, renormalize)[1])


@interpret
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 256])
def test_tiles_kernel_equals_twin(routing: tuple[int, int, bool], num_tokens: int) -> None:
    """Every field, the empty tiles past the last live one included; tokens all to one expert
    too (its tiles span the whole step)."""
    num_experts, top_k, _ = routing
    kernels = _kernels()
    for experts in (
        skewed_experts(num_tokens, num_experts, top_k, seed=num_tokens),
        torch.arange(top_k).repeat(num_tokens, 1),
    ):
        if kernels.tile_pair_tier(experts.numel()) is None:
            continue
        got = kernels.expert_tiles_triton(experts, num_experts, GROUPED_BLOCK_M)
        assert same_tiles(got, expert_tiles(experts, num_experts))
        assert got.tile_start.numel() == max_tiles(experts.numel(), num_experts)
        if experts.reshape(-1).bincount().max() > 1:  # an expert of two pairs: an order
            assert not same_tiles(got, unstable_tiles(experts, num_experts))


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_combine_kernel_equals_twin(dtype: torch.dtype, top_k: int) -> None:
    """Hidden sizes of one partial column block and of several."""
    generator = torch.Generator().manual_seed(top_k)
    for num_tokens, hidden in ((3, 48), (17, 2304)):
        outputs = torch.randn(num_tokens * top_k, hidden, generator=generator).to(dtype)
        outputs[0, :4] = -0.0  # a -0 product must stay -0 at rank 0
        weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=-1)
        got = _kernels().combine_ranks_triton(outputs, weights, dtype)
        assert torch.equal(got, combine_ranks_ref(outputs, weights, dtype))
        if top_k > 2 and dtype == torch.float32:  # (bfloat16's rounding can hide the order)
            assert not torch.equal(got, combined_worst_first(outputs, weights, dtype))


def _compile(kernel: object, signature: dict[str, str], constexprs: dict, warps: int) -> object:
    """PTX and a cubin for sm_90 through Triton's bundled ptxas (no GPU needed)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # under TRITON_INTERPRET=1: the plain function
        kernel = JITFunction(kernel.fn)
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    options = {"num_warps": warps, "enable_fp_fusion": False}
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as error:  # no bundled ptxas in this Triton build
        pytest.skip(f"no CUDA toolchain: {error}")


@pytest.mark.parametrize("routing", [(8, 2, True), (128, 8, False)])
def test_route_kernel_compiles_for_hopper(routing: tuple[int, int, bool]) -> None:
    pytest.importorskip("triton")
    from specdec.models.moe_routing_triton import _top_k_routes_kernel

    num_experts, top_k, renormalize = routing
    signature = {"probs_ptr": "*fp32", "weights_ptr": "*fp32", "experts_ptr": "*i64"}
    constexprs = {
        "NUM_EXPERTS": num_experts,
        "TOP_K": top_k,
        "RENORMALIZE": renormalize,
        "BLOCK_T": 16,
        "BLOCK_E": num_experts,
        "BLOCK_K": top_k,
    }
    compiled = _compile(_top_k_routes_kernel, {**signature, "num_tokens": "i32"}, constexprs, 4)
    assert compiled.asm["cubin"]
    assert ("div.rn.f32" in compiled.asm["ptx"]) == renormalize


@pytest.mark.parametrize("block_p", [64, 2048])
def test_tiles_kernel_compiles_for_hopper(block_p: int) -> None:
    pytest.importorskip("triton")
    from specdec.models.moe_routing_triton import _expert_tiles_kernel

    pointers = {"experts_ptr": "*i64", "pair_ptr": "*i64", "token_ptr": "*i64"}
    pointers["position_ptr"] = "*i64"
    for name in ("tile_expert_ptr", "tile_start_ptr", "tile_end_ptr"):
        pointers[name] = "*i32"
    constexprs = {
        "TOP_K": 8,
        "NUM_EXPERTS": 128,
        "BLOCK_M": GROUPED_BLOCK_M,
        "BLOCK_P": block_p,
        "BLOCK_E": 256,
        "BLOCK_S": 512,
    }
    signature = {**pointers, "num_pairs": "i32", "num_tiles": "i32"}
    compiled = _compile(_expert_tiles_kernel, signature, constexprs, 4 if block_p <= 512 else 8)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_combine_kernel_compiles_without_fma(dtype: str) -> None:
    """The products and sums stay separate roundings (the twin's), never one fused op."""
    pytest.importorskip("triton")
    from specdec.models.moe_routing_triton import _combine_ranks_kernel

    signature = {"outputs_ptr": f"*{dtype}", "weights_ptr": "*fp32", "out_ptr": f"*{dtype}"}
    constexprs = {"HIDDEN": 2048, "TOP_K": 8, "BLOCK_D": 1024}
    compiled = _compile(_combine_ranks_kernel, signature, constexprs, 4)
    ptx = compiled.asm["ptx"]
    assert "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx
