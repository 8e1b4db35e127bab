"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a float32 softmax router, top-k
experts per token, each expert a SwiGLU MLP. A token's output never depends on the other tokens
of its step (its experts' products are row-invariant, its weighted sum runs in rank order).
Under tensor parallelism a rank holds a slice of every expert's intermediate columns (the loader
reads it, `tensor_parallel.tensor_slice`) and the routed sum of its partial outputs is summed
over the ranks by one all-reduce, as the dense MLP's down projection. It never reads files or
samples.

Two ways to run the experts: the CPU's (each expert in turn over its gathered tokens), and the
grouped one (every (token, rank) pair sorted by expert into tiles of one expert, one grouped
product for gate/up and one for down over all experts: `moe_triton.py`, CUDA's default since s27
(bit for bit its twin, and the engine's greedy and speculative tokens `transformers`' on an H100
in s26), switched off with SPECDEC_MOE_GROUPED_KERNEL=0; `grouped_linear_ref`, its twin).
On CUDA the routes, the layout and the combination are one launch each
(`moe_routing_triton.py`, bit for bit `top_k_routes_ref`, `moe_tiles.expert_tiles` and
`combine_ranks_ref`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from specdec.models.fused import silu_mul
from specdec.models.layers import Linear
from specdec.models.linear import batch_invariant_linear
from specdec.models.moe_tiles import GROUPED_BLOCK_M, ExpertTiles, expert_tiles
from specdec.models.tensor_parallel import Collectives

# The depth of the grouped product's K step, fixed whatever the step's row count (a row's bits
# depend on the K steps alone: see `moe_triton.py`; the twin sums its K steps in the same order);
# its tile of pairs is `moe_tiles.GROUPED_BLOCK_M`.
GROUPED_BLOCK_K = 64
# The environment switch of the grouped kernel on CUDA (and of the CUDA decode path for MoE
# models: `ModelConfig.decode_path_reason` reads the same name): on unless set to 0. Off: CUDA
# runs the CPU's loop eagerly (a host sync per expert and layer: 578 ms a token for the
# Qwen3-30B-A3B shape on an H100, s27), and the decode path refuses the model.
GROUPED_KERNEL_ENV = "SPECDEC_MOE_GROUPED_KERNEL"


def takes_grouped_path(x: torch.Tensor) -> bool:
    """Whether a step on `x`'s device runs the grouped experts: CUDA unless `GROUPED_KERNEL_ENV`
    is 0 (tests replace this to run CPU steps through the kernel under Triton's interpreter)."""
    return x.is_cuda and os.environ.get(GROUPED_KERNEL_ENV, "1") != "0"


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)) (Mixtral's w1 / w3 / w2)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]; each row as it would be alone: row-invariant products
        (`Linear.decode`), and the activation over (gate | up) rows as the dense MLP takes it
        (`silu_mul`: a strided view, one inner loop per row; over a contiguous [N, F] the CPU's
        vectorised SiLU gives the elements of its last partial vector other bits)."""
        gate_up = torch.cat([self.gate_proj.decode(x), self.up_proj.decode(x)], dim=-1)
        return self.down_proj.decode(silu_mul(gate_up))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing rule of Mixtral and Qwen3-MoE: softmax over all experts' logits (float32),
    then the top-k probabilities, then (with `renormalize`) divided by their sum
    (`top_k_routes`).

    Args:
        router_logits: [T, E] the router's logits.
        top_k: experts per token.
        renormalize: divide the kept probabilities by their sum (Mixtral always; Qwen3-MoE's
            `norm_topk_prob`).

    Returns: ([T, k] float32 weights, [T, k] int64 expert ids), ranked by probability.
    """
    return top_k_routes(torch.softmax(router_logits.float(), dim=-1), top_k, renormalize)


def top_k_routes_ref(
    probs: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of each token's expert probabilities, ranked, and (with `renormalize`) each
    divided by their sum, summed rank by rank from the best (the twin of
    `moe_routing_triton.top_k_routes_triton`, which sums in that order too).

    Ties go to the lower expert id (a stable descending sort), so a route never depends on the
    sort kernel's choice among equal values.

    Args: probs: [T, E] float32. top_k: experts per token. renormalize: see `route`.
    Returns: ([T, k] float32 weights, [T, k] int64 expert ids)."""
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if renormalize:
        total = weights[:, 0]
        for rank in range(1, top_k):
            total = total + weights[:, rank]
        weights = weights / total[:, None]
    return weights, experts


def top_k_routes(
    probs: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `top_k_routes_ref`; one kernel launch on CUDA (`moe_routing_triton.py`)."""
    if not probs.is_cuda:
        return top_k_routes_ref(probs, top_k, renormalize)
    from specdec.models import moe_routing_triton

    return moe_routing_triton.top_k_routes_triton(probs, top_k, renormalize)


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over rank r of weights[:, r] x outputs[:, r], in rank order (best expert first),
    in float32: a token's sum never depends on which expert ids it was routed to.

    Args: outputs: [T, k, D] float32 expert outputs by rank. weights: [T, k] float32.
    Returns: [T, D] float32."""
    total = outputs[:, 0] * weights[:, :1]
    for rank in range(1, outputs.shape[1]):
        total = total + outputs[:, rank] * weights[:, rank : rank + 1]
    return total


def combine_ranks_ref(
    outputs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Each token's expert outputs, [T x k, D] by (token, rank) in any float dtype, widened to
    float32, summed by `weighted_sum` (rank order) and cast to `dtype` once: the twin of
    `moe_routing_triton.combine_ranks_triton`. weights: [T, k] float32. Returns [T, D]."""
    num_tokens, top_k = weights.shape
    return weighted_sum(outputs.view(num_tokens, top_k, -1).float(), weights).to(dtype)


def combine_ranks(outputs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """See `combine_ranks_ref`; one kernel launch on CUDA (`moe_routing_triton.py`)."""
    if not outputs.is_cuda:
        return combine_ranks_ref(outputs, weights, dtype)
    from specdec.models import moe_routing_triton

    return moe_routing_triton.combine_ranks_triton(outputs, weights, dtype)


def step_tiles(experts: torch.Tensor, num_experts: int) -> ExpertTiles:
    """The step's grouped layout (`moe_tiles.expert_tiles`, its twin): one kernel launch on CUDA
    up to `moe_routing_triton.TILE_PAIR_TIERS`' largest pair count, the twin's torch
    operations past it (the same integers)."""
    if experts.is_cuda:
        from specdec.models import moe_routing_triton

        if moe_routing_triton.tile_pair_tier(experts.numel()) is not None:
            return moe_routing_triton.expert_tiles_triton(experts, num_experts, GROUPED_BLOCK_M)
    return expert_tiles(experts, num_experts)


def grouped_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: ExpertTiles,
    source: torch.Tensor,
    dest: torch.Tensor,
    num_out_rows: int,
    block_k: int,
) -> torch.Tensor:
    """out[dest[s]] = x[source[s]] W_e^T for each sorted position s of expert e: the twin of
    `moe_triton.grouped_linear_triton`, tile by tile in its arithmetic order (rows padded with
    zeros to the tile's `block_m`, K in steps of `block_k` from 0 upwards, each step's [M, N]
    float32 product added to a float32 accumulator, rounded to x's dtype once). Under Triton's
    interpreter the kernel gives these bits: its dot is numpy's GEMM, which over contiguous
    tiles gave PyTorch's CPU GEMM's bits in every case tested (a transposed view did not:
    the kernel loads W^T tiles instead of transposing). On a GPU the dot sums in its own order.

    Args:
        x: [R, K] source rows. weight: [E, N, K] stacked expert weights in x's dtype.
        tiles: the step's layout. source, dest: [P] int64 row of x read / row of out written
            at each sorted position. num_out_rows: out's rows (each written once).
        block_k: the K step (GROUPED_BLOCK_K; a negative control changes it).

    Returns: [num_out_rows, N] in x's dtype.
    """
    num_cols, depth = weight.shape[1], weight.shape[2]
    out = x.new_zeros(num_out_rows, num_cols)
    starts, ends = tiles.tile_start.tolist(), tiles.tile_end.tolist()
    for expert, start, end in zip(tiles.tile_expert.tolist(), starts, ends, strict=True):
        if start >= end:
            continue
        rows = torch.arange(start, min(start + tiles.block_m, end), device=x.device)
        tile = x.new_zeros(tiles.block_m, depth, dtype=torch.float32)
        tile[: rows.numel()] = x[source[rows]].float()
        w = weight[expert].float()  # [N, K]
        acc = torch.zeros(tiles.block_m, num_cols, dtype=torch.float32, device=x.device)
        for k in range(0, depth, block_k):
            acc = acc + tile[:, k : k + block_k] @ w[:, k : k + block_k].t()
        out[dest[rows]] = acc[: rows.numel()].to(x.dtype)
    return out


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: ExpertTiles,
    source: torch.Tensor,
    dest: torch.Tensor,
    num_out_rows: int,
    block_k: int,
) -> torch.Tensor:
    """See `grouped_linear_ref`; one kernel launch on CUDA (`moe_triton.py`)."""
    if not x.is_cuda:
        return grouped_linear_ref(x, weight, tiles, source, dest, num_out_rows, block_k)
    from specdec.models import moe_triton

    return moe_triton.grouped_linear_triton(x, weight, tiles, source, dest, num_out_rows, block_k)


# (x, weight, tiles, source, dest, num_out_rows, block_k) -> out: `grouped_linear`'s signature.
GroupedLinear = Callable[
    [torch.Tensor, torch.Tensor, ExpertTiles, torch.Tensor, torch.Tensor, int, int], torch.Tensor
]


def grouped_experts(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    product: GroupedLinear | None = None,
) -> torch.Tensor:
    """The experts of every token and their weighted sum, grouped: 1. the pairs sorted by
    expert (`step_tiles`); 2. gate/up of every pair in one grouped product ([P, 2F], sorted
    order, rounded to x's dtype as the separate products are); 3. `silu_mul` (the dense MLP's
    activation, row by row); 4. down in one grouped product, written to each pair's (token,
    rank) row; 5. `combine_ranks`: `weighted_sum` in rank order, cast once.

    Args:
        x: [T, D] normed hidden states.
        gate_up_weight: [E, 2F, D] each expert's gate rows then up rows. down_weight: [E, D, F].
        weights, experts: [T, k] the routes (`route`).
        product: the grouped product (None: `grouped_linear`, the kernel on CUDA and its
            twin elsewhere; tests pass the kernel or a broken variant).

    Returns: [T, D] in x's dtype.
    """
    product = grouped_linear if product is None else product
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    tiles = step_tiles(experts, gate_up_weight.shape[0])
    block_k = GROUPED_BLOCK_K
    gate_up = product(x, gate_up_weight, tiles, tiles.token, tiles.position, num_pairs, block_k)
    gated = silu_mul(gate_up)  # [P, F] in sorted order
    outputs = product(gated, down_weight, tiles, tiles.position, tiles.pair, num_pairs, block_k)
    return combine_ranks(outputs, weights, x.dtype)  # [P, D] by (token, rank) -> [T, D]


class SparseMoeBlock(nn.Module):
    """Router (`gate`, [E, D]) and `experts`; out = sum over rank r of weight_r x expert_r(x).

    Steps: 1. router logits in float32 (a row-invariant product of x and the router's
    weight, widened); 2. `route`; 3. per expert, in id order, its tokens gathered and computed
    (`Expert`: products whose rows do not depend on the row count); 4. each token's outputs
    summed in float32 by rank (best expert first), not by expert id, and cast once. `forward`
    and `forward_decode` are the same computation. With the grouped kernel switched on
    (`takes_grouped_path`), CUDA steps run 3. and 4. as
    `grouped_experts` over the stacked weights (`fuse`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size) for _ in range(num_experts)
        )
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp: Collectives | None = None  # sums the ranks' partial outputs (`attach_collectives`)
        # The experts' weights stacked by `fuse` (plain attributes: each expert's parameters
        # become views of them, so the state dict keeps the checkpoint's names).
        self.gate_up_weight: torch.Tensor | None = None  # [E, 2F, D]
        self.down_weight: torch.Tensor | None = None  # [E, D, F]

    def fuse(self) -> None:
        """Stacks the experts' weights into [E, 2F, D] (gate rows, then up rows) and
        [E, D, F] for the grouped products; each expert's weights become views of them (no
        extra memory once the originals are freed). Mutates: the experts' `weight.data`."""
        if self.gate_up_weight is not None:
            return
        linears = [linear for e in self.experts for linear in (e.gate_proj, e.up_proj, e.down_proj)]
        if any(linear.quantized is not None for linear in linears):
            return  # refused at load (a quantized MoE model); nothing to stack
        width = self.experts[0].gate_proj.out_features
        gate_up = torch.stack(
            [torch.cat([e.gate_proj.weight.data, e.up_proj.weight.data]) for e in self.experts]
        )
        down = torch.stack([e.down_proj.weight.data for e in self.experts])
        for index, expert in enumerate(self.experts):
            expert.gate_proj.weight.data = gate_up[index, :width]
            expert.up_proj.weight.data = gate_up[index, width:]
            expert.down_proj.weight.data = down[index]
        self.gate_up_weight, self.down_weight = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        if self.gate.quantized is not None:
            raise ValueError("a quantized mixture-of-experts router is not supported")
        # [T, E] float32: the widened product (on CUDA the 16-bit values' float32 sums)
        logits = batch_invariant_linear(x, self.gate.weight, out_dtype=torch.float32)
        weights, experts = route(logits, self.top_k, self.renormalize)  # [T, k] each
        if takes_grouped_path(x):
            return self._reduce(self.forward_grouped(x, weights, experts))
        outputs = x.new_zeros(x.shape[0], self.top_k, x.shape[1], dtype=torch.float32)
        for expert_id, expert in enumerate(self.experts):
            tokens, ranks = torch.nonzero(experts == expert_id, as_tuple=True)
            if tokens.numel() == 0:
                continue
            outputs[tokens, ranks] = expert(x[tokens]).float()
        return self._reduce(weighted_sum(outputs, weights).to(x.dtype))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism, the ranks' routed sums (each over its slice of every
        expert's columns) summed over the ranks; else `partial` itself."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def forward_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Steps 3. and 4. through `grouped_experts` (stacking the weights on first use when
        `fuse` has not run). x: [T, D]; weights, experts: [T, k]. Returns [T, D]."""
        self.fuse()
        if self.gate_up_weight is None or self.down_weight is None:
            raise ValueError("quantized experts have no grouped path")
        return grouped_experts(x, self.gate_up_weight, self.down_weight, weights, experts)

    def forward_decode(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` (the decode path's MLP: the same bits for a token on either path)."""
        return self.forward(x)
