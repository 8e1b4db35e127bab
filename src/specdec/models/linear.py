"""Float products whose rows never depend on the batch: `linear` (dispatch) and its twin
`linear_ref`.

A decode row's logits must not change with what shares its step (other requests' decode,
verify or prefill rows, the CUDA-graph bucket): cuBLAS picks its kernel, split-K included, by
the row count, so on CUDA every float product of the model runs `linear_triton`, whose tiles are
a function of the weight alone. On the CPU the product is F.linear (the kept-quantized default
takes the weight-only kernels of `quant.py` instead). Nothing here draws randomness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Whether CUDA products take the row-invariant kernel (probes measure its cost by turning it
# off; the engine never does).
ROW_INVARIANT_ON_CUDA = True


def batch_invariant_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ bias) computed in float32 and rounded to x's dtype once (the twin the kernel is
    compared with: equal up to the kernel's float32 accumulation order).

    Args: x: [M, K]. weight: [N, K]. bias: [N] or None. Returns: [M, N] in x's dtype."""
    out = x.to(torch.float32) @ weight.to(torch.float32).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ bias) for x of [..., K] and weight [N, K]: on CUDA through `linear_triton`
    (every row computed as it would be alone), elsewhere F.linear. Returns [..., N]."""
    if not (x.is_cuda and ROW_INVARIANT_ON_CUDA) or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    from specdec.models.linear_triton import linear_triton

    if x.dim() == 2:
        return linear_triton(x, weight, bias)
    lead = x.shape[:-1]
    out = linear_triton(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*lead, out.shape[-1])
