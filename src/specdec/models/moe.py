"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a float32 softmax router, top-k
experts per token, each expert a SwiGLU MLP. A token's output never depends on the other tokens
of its step (its experts' products are row-invariant, its weighted sum runs in rank order). It
never reads files, samples, or shards experts (tensor parallelism is refused by the model).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.fused import silu_mul
from specdec.models.layers import Linear
from specdec.models.linear import batch_invariant_linear


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
    then the top-k probabilities, then (with `renormalize`) divided by their sum.

    Ties go to the lower expert id (a stable descending sort), so a route never depends on the
    sort kernel's choice among equal values.

    Args:
        router_logits: [T, E] the router's logits.
        top_k: experts per token.
        renormalize: divide the kept probabilities by their sum (Mixtral always; Qwen3-MoE's
            `norm_topk_prob`).

    Returns: ([T, k] float32 weights, [T, k] int64 expert ids), ranked by probability.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    """Router (`gate`, [E, D]) and `experts`; out = sum over rank r of weight_r x expert_r(x).

    Steps: 1. router logits in float32 (a row-invariant product); 2. `route`; 3. per expert, in
    id order, its tokens gathered and computed (`Expert`: products whose rows do not depend on
    the row count); 4. each token's outputs summed in float32 by rank (best expert first), not by
    expert id, and cast once. `forward` and `forward_decode` are the same computation.
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

    def fuse(self) -> None:
        """Nothing to fuse (each expert keeps its gate and up products)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        if self.gate.quantized is not None:
            raise ValueError("a quantized mixture-of-experts router is not supported")
        logits = batch_invariant_linear(x.float(), self.gate.weight.float())  # [T, E]
        weights, experts = route(logits, self.top_k, self.renormalize)  # [T, k] each
        outputs = x.new_zeros(x.shape[0], self.top_k, x.shape[1], dtype=torch.float32)
        for expert_id, expert in enumerate(self.experts):
            tokens, ranks = torch.nonzero(experts == expert_id, as_tuple=True)
            if tokens.numel() == 0:
                continue
            outputs[tokens, ranks] = expert(x[tokens]).float()
        total = outputs[:, 0] * weights[:, :1]
        for rank in range(1, self.top_k):
            total = total + outputs[:, rank] * weights[:, rank : rank + 1]
        return total.to(x.dtype)

    def forward_decode(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` (the decode path's MLP: the same bits for a token on either path)."""
        return self.forward(x)
