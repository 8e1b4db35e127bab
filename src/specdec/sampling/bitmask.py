"""Applying grammar bitmasks to logit rows: `apply_bitmask` (dispatch) and `apply_bitmask_ref`
(the PyTorch twin). Only the rows named are touched, so unconstrained rows of a batch cost
nothing. Never draws randomness.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, W] int32 bitmasks -> [M, V] bool allowed tokens."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [M, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets logits[rows[m], t] to -inf where bit t of bitmask[m] is 0.

    Args:
        logits: [N, V] float32, modified in place.
        bitmask: [M, W] int32, W = ceil(V / 32); bit t % 32 of word t // 32 allows token t.
        rows: [M] int64 the row of logits each bitmask applies to (distinct).

    Mutates: logits.
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`apply_bitmask_ref`, by one Triton kernel on CUDA tensors (same result, bit for bit).

    Mutates: logits.
    """
    if bitmask.shape[0] == 0:
        return
    if logits.is_cuda and logits.is_contiguous() and logits.dtype == torch.float32:
        from specdec.sampling.bitmask_triton import apply_bitmask_triton

        apply_bitmask_triton(logits, bitmask.contiguous(), rows)
        return
    apply_bitmask_ref(logits, bitmask, rows)
