"""RMSNorm's numerics per family, in one place: the PyTorch definition that `layers.RMSNorm` and
the twins of the fused kernels (`fused.add_rms_norm_ref`, `fused.qk_norm_ref`) compute, and the
codes the Triton kernels take for it (`fused_triton`).

Every family normalises in float32 as `transformers` does; they differ in where the weight
applies: Llama casts back to the input dtype and then scales (LLAMA); OLMo 2 scales in float32,
then casts (FLOAT32_WEIGHT); Gemma scales by (1 + weight) in float32, then casts (UNIT_OFFSET).
"""

from __future__ import annotations

import torch

LLAMA = 0
FLOAT32_WEIGHT = 1
UNIT_OFFSET = 2
NUMERICS = (LLAMA, FLOAT32_WEIGHT, UNIT_OFFSET)


def rms_norm_values(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    numerics: int,
    mean_square: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension with `numerics` (one of NUMERICS), in x's dtype.
    `mean_square` ([..., 1] float32): the mean of the squares to normalise by, when `x` is a
    rank's slice of a wider vector (tensor parallelism); None: x's own."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    if mean_square is None:
        mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + eps)
    if numerics == UNIT_OFFSET:
        return (x * (1.0 + weight.float())).to(input_dtype)
    if numerics == FLOAT32_WEIGHT:
        return (weight * x).to(input_dtype)
    return weight * x.to(input_dtype)
