"""The grouped mixture-of-experts path (`moe.grouped_experts`): its layout (`expert_tiles`), its
twin (`grouped_linear_ref`) against the CPU's per-expert loop, and its Triton kernel
(`moe_triton.grouped_linear_triton`) against the twin bit for bit under Triton's CPU
interpreter (tests marked `interpret`: skipped unless TRITON_INTERPRET=1 and Triton is
importable; tests/parity/test_moe_gpu.py runs the kernel on a GPU), and compiled for sm_90
without a GPU (Triton's bundled ptxas: what the GPU compiler refuses). A token's output alone
equals its output in batches of 1..N tokens routed to the same and to other experts, in either
order, bit for bit (kernel and twin). Negative controls, each of which the same check must
reject: a K step of 32 instead of 64 (other bits), a K step that follows the row count (a
token's bits change with its batch), the ranks summed in reverse (other bits at top-3), routes
to other experts (other outputs). The switch: CUDA takes the kernel, and its decode path takes
MoE models, unless SPECDEC_MOE_GROUPED_KERNEL=0.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.models import ModelConfig, moe
from specdec.models.linear import batch_invariant_linear
from specdec.models.moe import (
    GROUPED_BLOCK_K,
    GROUPED_KERNEL_ENV,
    SparseMoeBlock,
    grouped_experts,
    grouped_linear_ref,
    route,
    weighted_sum,
)
from specdec.models.moe_tiles import GROUPED_BLOCK_M, expert_tiles, max_tiles

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
DTYPES = [torch.float32, torch.bfloat16]
# (experts, hidden D, expert width F): D of 32 (one partial K step) and 64, F of 64 to 128
# (96: a partial K step in down).
SHAPES = [(4, 32, 64), (8, 64, 96), (6, 64, 128)]


def _kernel() -> moe.GroupedLinear:
    from specdec.models import moe_triton

    return moe_triton.grouped_linear_triton


def random_block(
    num_experts: int, hidden: int, width: int, top_k: int = 2, seed: int = 0, fuse: bool = True
) -> SparseMoeBlock:
    """A float32 block with weights ~N(0, 0.1^2) and a router ~N(0, 1) (routes far from ties),
    its experts stacked (`fuse`) unless told not to."""
    block = SparseMoeBlock(hidden, width, num_experts, top_k, renormalize=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in block.named_parameters():
            scale = 1.0 if name == "gate.weight" else 0.1
            param.copy_(scale * torch.randn(param.shape, generator=generator))
    if fuse:
        block.fuse()
    return block


def skewed_routes(
    num_tokens: int, num_experts: int, top_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes of random logits with expert 0 favoured: in a batch of 20 tokens expert 0 holds
    more than GROUPED_BLOCK_M pairs (two tiles) while others hold a few or none."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, 0] += 2.0
    return route(logits, top_k, renormalize=True)


def block_inputs(
    block: SparseMoeBlock, num_tokens: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, D], gate_up [E, 2F, D], down [E, D, F], weights, experts [T, k]) in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, block.gate.in_features, generator=generator).to(dtype)
    weights, experts = skewed_routes(num_tokens, len(block.experts), block.top_k, seed + 1)
    assert block.gate_up_weight is not None and block.down_weight is not None
    return x, block.gate_up_weight.to(dtype), block.down_weight.to(dtype), weights, experts


# --------------------------------------------------------------------------- layout
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 16, 40])
def test_expert_tiles_cover_every_pair_once(num_experts: int, num_tokens: int) -> None:
    """Every sorted position lies in exactly one live tile of at most GROUPED_BLOCK_M positions
    of one expert; positions are sorted by expert, then by pair index; `token` is pair // k;
    the tile count follows the token count alone (max_tiles), whatever the routes."""
    top_k = 2
    _, experts = skewed_routes(num_tokens, num_experts, top_k, seed=num_tokens)
    tiles = expert_tiles(experts, num_experts)
    num_pairs = num_tokens * top_k
    flat = experts.reshape(-1)
    assert tiles.tile_start.shape == (max_tiles(num_pairs, num_experts),)
    assert sorted(tiles.pair.tolist()) == list(range(num_pairs))
    assert torch.equal(tiles.token, tiles.pair // top_k)
    keys = flat[tiles.pair] * num_pairs + tiles.pair  # expert, then pair index
    assert torch.equal(keys, keys.sort().values)
    covered = torch.zeros(num_pairs, dtype=torch.int64)
    for expert, start, end in zip(
        tiles.tile_expert.tolist(), tiles.tile_start.tolist(), tiles.tile_end.tolist(), strict=True
    ):
        if start >= end:
            continue
        stop = min(start + GROUPED_BLOCK_M, end)
        covered[start:stop] += 1
        assert (flat[tiles.pair[start:stop]] == expert).all()
    assert (covered == 1).all()
    # Any other routes of as many tokens: the same sizes (a CUDA graph's buffers).
    other = expert_tiles(torch.zeros_like(experts), num_experts)
    assert other.tile_start.shape == tiles.tile_start.shape


# --------------------------------------------------------------------------- twin
@pytest.mark.parametrize("num_experts,hidden,width", SHAPES)
def test_twin_matches_the_cpu_loop(num_experts: int, hidden: int, width: int) -> None:
    """The grouped twin gives the CPU loop's outputs (`SparseMoeBlock.forward`: the same
    routes, products in another blocking) within float32 rounding; routes to other experts
    (each id + 1) move them far off (negative control)."""
    block = random_block(num_experts, hidden, width, seed=num_experts)
    x = torch.randn(23, hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        logits = batch_invariant_linear(x, block.gate.weight)
        weights, experts = route(logits, block.top_k, block.renormalize)
        got = grouped_experts(
            x, block.gate_up_weight, block.down_weight, weights, experts, grouped_linear_ref
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        wrong = grouped_experts(
            x,
            block.gate_up_weight,
            block.down_weight,
            weights,
            (experts + 1) % num_experts,
            grouped_linear_ref,
        )
    assert (wrong - want).abs().max() > 100 * 1e-5


# --------------------------------------------------------------------------- kernel == twin
@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts,hidden,width", SHAPES)
def test_kernel_equals_twin_bit_for_bit(
    dtype: torch.dtype, num_experts: int, hidden: int, width: int
) -> None:
    """Both grouped products, and the whole grouped MLP, over 20 tokens with an expert of two
    tiles and experts of none: the kernel's bits are the twin's."""
    block = random_block(num_experts, hidden, width, seed=3)
    x, gate_up, down, weights, experts = block_inputs(block, 20, dtype, seed=4)
    tiles = expert_tiles(experts, num_experts)
    num_pairs = experts.numel()
    kernel = _kernel()
    gate_args = (x, gate_up, tiles, tiles.token, tiles.position, num_pairs, GROUPED_BLOCK_K)
    want = grouped_linear_ref(*gate_args)
    got = kernel(*gate_args)
    assert got.dtype == dtype and torch.equal(got, want)
    gated = torch.randn(num_pairs, width, generator=torch.Generator().manual_seed(5)).to(dtype)
    down_args = (gated, down, tiles, tiles.position, tiles.pair, num_pairs, GROUPED_BLOCK_K)
    assert torch.equal(kernel(*down_args), grouped_linear_ref(*down_args))
    want = grouped_experts(x, gate_up, down, weights, experts, grouped_linear_ref)
    assert torch.equal(grouped_experts(x, gate_up, down, weights, experts, kernel), want)


@interpret
def test_kernel_with_another_k_step_differs() -> None:
    """Negative control: the kernel walking K in steps of 32 (D = 64: two steps, not one)
    gives other bits than the twin's steps of 64, which the bit-for-bit check must see."""
    block = random_block(8, 64, 128, seed=6)
    x, gate_up, _, _, experts = block_inputs(block, 20, torch.float32, seed=7)
    tiles = expert_tiles(experts, 8)
    args = (x, gate_up, tiles, tiles.token, tiles.position, experts.numel())
    want = grouped_linear_ref(*args, GROUPED_BLOCK_K)
    assert torch.equal(_kernel()(*args, GROUPED_BLOCK_K), want)
    assert not torch.equal(_kernel()(*args, 32), want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("depth", [4096, 96])
def test_kernel_compiles_for_hopper(dtype: str, depth: int) -> None:
    """The GPU compiler takes the kernel (the interpreter accepts code it refuses): PTX and a
    cubin for sm_90 through Triton's bundled ptxas, no GPU needed; bfloat16 on tensor cores
    (mma), float32 as FMA chains (input_precision="ieee")."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from specdec.models.moe_triton import GROUPED_BLOCK_N, _grouped_linear_kernel

    pointers = {name: f"*{dtype}" for name in ("x_ptr", "weight_ptr", "out_ptr")}
    indices = {"source_ptr": "*i64", "dest_ptr": "*i64"}
    tiles = {name: "*i32" for name in ("tile_expert_ptr", "tile_start_ptr", "tile_end_ptr")}
    constexprs = {
        "NUM_COLS": 2 * 1536,
        "DEPTH": depth,
        "BLOCK_M": GROUPED_BLOCK_M,
        "BLOCK_N": GROUPED_BLOCK_N,
        "BLOCK_K": GROUPED_BLOCK_K,
        "IEEE": dtype == "fp32",
        "EVEN_K": depth % GROUPED_BLOCK_K == 0,
        "WIDEN": False,
    }
    signature = {**pointers, **indices, **tiles, "x_stride": "i32", "out_stride": "i32"}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    kernel = _grouped_linear_kernel
    if not isinstance(kernel, JITFunction):  # under TRITON_INTERPRET=1: the plain function
        kernel = JITFunction(kernel.fn)
    source = ASTSource(kernel, signature, constexprs=constexprs)
    try:
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}
        )
    except FileNotFoundError as error:  # no bundled ptxas in this Triton build
        pytest.skip(f"no CUDA toolchain: {error}")
    assert compiled.asm["cubin"]
    assert ("mma" in compiled.asm["ptx"]) == (dtype == "bf16")


# --------------------------------------------------------------------------- batch invariance
def rows_alone_and_batched(
    product: moe.GroupedLinear, dtype: torch.dtype, num_tokens: int = 20
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(each token's output alone [N, D], the outputs of batches x[:n] for n = 1..N and of x
    reversed (put back in order)), from the grouped MLP with `product`."""
    block = random_block(8, 64, 96, seed=8)
    x, gate_up, down, weights, experts = block_inputs(block, num_tokens, dtype, seed=9)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x[rows], gate_up, down, weights[rows], experts[rows], product)

    alone = torch.cat([run(torch.tensor([i])) for i in range(num_tokens)])
    batches = [run(torch.arange(n)) for n in range(1, num_tokens + 1)]
    batches.append(run(torch.arange(num_tokens).flip(0)).flip(0))
    return alone, batches


def batch_invariant(alone: torch.Tensor, batches: list[torch.Tensor]) -> bool:
    return all(torch.equal(batch, alone[: batch.shape[0]]) for batch in batches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_token_alone_equals_token_in_any_batch(dtype: torch.dtype) -> None:
    """The twin: each of 20 tokens alone == in every prefix batch and in the reversed batch
    (other tokens routed to its experts and to others; expert 0's pairs spanning two tiles)."""
    assert batch_invariant(*rows_alone_and_batched(grouped_linear_ref, dtype))


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_token_alone_equals_token_in_any_batch(dtype: torch.dtype) -> None:
    """The kernel: as the twin's test."""
    assert batch_invariant(*rows_alone_and_batched(_kernel(), dtype))


def k_step_by_row_count(product: moe.GroupedLinear) -> moe.GroupedLinear:
    """`product` whose K step follows the row count (32 from 9 pairs on, else 64): the split
    the dense kernel must never make."""

    def broken(*args: Any) -> torch.Tensor:
        x, weight, tiles, source, dest, num_out_rows, block_k = args
        step = 32 if source.shape[0] > 8 else block_k
        return product(x, weight, tiles, source, dest, num_out_rows, step)

    return broken


def test_batch_invariance_negative_control_twin() -> None:
    """Negative control: the twin with a K step chosen by the row count fails the check."""
    broken = k_step_by_row_count(grouped_linear_ref)
    assert not batch_invariant(*rows_alone_and_batched(broken, torch.float32))


@interpret
def test_batch_invariance_negative_control_kernel() -> None:
    """Negative control: the kernel with a K step chosen by the row count fails the check."""
    broken = k_step_by_row_count(_kernel())
    assert not batch_invariant(*rows_alone_and_batched(broken, torch.float32))


# --------------------------------------------------------------------------- combine order
def reversed_sum(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`moe.weighted_sum` over the ranks worst first (a negative control)."""
    return weighted_sum(outputs.flip(1), weights.flip(1))


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=interpret)])
def test_rank_order_sum_negative_control(use_kernel: bool, monkeypatch: Any) -> None:
    """At top-3 (two of the three terms of a sum can swap) the ranks summed worst first give
    other bits than best first, which the bit-for-bit checks must see."""
    product = _kernel() if use_kernel else grouped_linear_ref
    block = random_block(8, 64, 64, top_k=3, seed=10)
    x, gate_up, down, weights, experts = block_inputs(block, 20, torch.float32, seed=11)
    want = grouped_experts(x, gate_up, down, weights, experts, grouped_linear_ref)
    assert torch.equal(grouped_experts(x, gate_up, down, weights, experts, product), want)
    monkeypatch.setattr(moe, "weighted_sum", reversed_sum)
    flipped = grouped_experts(x, gate_up, down, weights, experts, product)
    torch.testing.assert_close(flipped, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(flipped, want)


# --------------------------------------------------------------------------- the block
def test_fuse_stacks_the_experts_as_views() -> None:
    """`fuse` stacks gate/up and down once: each expert's weights become views of the stacks
    (no copy kept), the state dict keeps its names, and the CPU loop's bits are unchanged."""
    block = random_block(4, 32, 64, seed=12)  # fused
    unfused = random_block(4, 32, 64, seed=12, fuse=False)
    assert unfused.gate_up_weight is None
    assert list(block.state_dict()) == list(unfused.state_dict())
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(13))
    stack = block.gate_up_weight
    assert stack is not None and block.down_weight is not None
    assert stack.shape == (4, 128, 32) and block.down_weight.shape == (4, 32, 64)
    for index, expert in enumerate(block.experts):
        assert expert.up_proj.weight.data_ptr() == stack[index, 64:].data_ptr()
        assert expert.down_proj.weight.data_ptr() == block.down_weight[index].data_ptr()
    with torch.no_grad():
        assert torch.equal(block(x), unfused(x))
    block.fuse()  # idempotent
    assert block.gate_up_weight is stack


def test_the_switch_names_the_grouped_kernel(monkeypatch: Any) -> None:
    """On (the default, or SPECDEC_MOE_GROUPED_KERNEL=1): CUDA's decode path takes MoE models
    and CUDA tensors take the grouped path; off (=0): the decode path refuses them naming the
    switch, and CUDA runs the CPU's loop. The CPU never takes the grouped path."""
    from models_fixtures import MOE_CONFIGS

    config = ModelConfig.from_hf_config(MOE_CONFIGS["mixtral"])
    for value in (None, "1"):
        if value is None:
            monkeypatch.delenv(GROUPED_KERNEL_ENV, raising=False)
        else:
            monkeypatch.setenv(GROUPED_KERNEL_ENV, value)
        assert config.decode_path_reason("cuda") is None
        assert not moe.takes_grouped_path(torch.zeros(1))
    monkeypatch.setenv(GROUPED_KERNEL_ENV, "0")
    reason = config.decode_path_reason("cuda")
    assert reason is not None and GROUPED_KERNEL_ENV in reason and "\n" not in reason
    assert config.decode_path_reason("cpu") is None
    meta = torch.empty(1, device="meta")
    assert not moe.takes_grouped_path(meta) and not moe.takes_grouped_path(torch.zeros(1))


# --------------------------------------------------------------------------- a model
@interpret
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_tiny_moe_model_through_the_kernel(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny checkpoint whose MoE layers run the grouped kernel (switched on for the CPU under
    the interpreter): prompt logits within 1e-4 of `transformers` and of the CPU loop, decode
    path steps too, and each prompt alone == in the batch bit for bit."""
    pytest.importorskip("transformers", reason="the forward reference")
    from models_fixtures import (
        decode_path_error,
        hf_logits,
        make_moe_hf_model,
        prompt_error,
        prompt_tokens,
        save_hf_model,
    )
    from specdec.models import load_model, prompt_logits

    hf_model = make_moe_hf_model(name)
    path = save_hf_model(hf_model, tmp_path)
    prompts = prompt_tokens(97, [1, 6, 17], seed=2)
    loop = prompt_logits(load_model(path).model, prompts, block_size=4)
    kernel = _kernel()
    launches = []

    def counted(*args: Any) -> torch.Tensor:
        launches.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(moe, "takes_grouped_path", lambda x: True)
    monkeypatch.setattr(moe, "grouped_linear", counted)
    model = load_model(path).model
    assert prompt_error(model, hf_model, prompts) <= 1e-4
    assert launches, "the grouped kernel never ran"
    batched = prompt_logits(model, prompts, block_size=4)
    for one, two in zip(batched, loop, strict=True):
        torch.testing.assert_close(one, two, atol=1e-4, rtol=1e-4)
    for prompt, in_batch in zip(prompts, batched, strict=True):
        assert torch.equal(prompt_logits(model, [prompt], block_size=4)[0], in_batch)
    sequences = prompt_tokens(97, [12, 9], seed=6)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    assert decode_path_error(model, references, sequences) <= 1e-4
