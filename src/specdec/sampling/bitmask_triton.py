"""The Triton kernel behind `specdec.sampling.bitmask.apply_bitmask`: one program per (masked
row, block of tokens), reading the row's bitmask words and writing -inf where a bit is 0."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [N, V] float32
    bitmask_ptr,  # [M, W] int32
    rows_ptr,  # [M] int64
    vocab,
    num_words,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    lanes = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = lanes < vocab
    row = tl.load(rows_ptr + m)
    words = tl.load(bitmask_ptr + m * num_words + lanes // 32, mask=inside, other=0)
    allowed = (words >> (lanes % 32)) & 1
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * vocab + lanes, neg_inf, mask=inside & (allowed == 0))


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Args as `apply_bitmask_ref`; logits contiguous float32 on CUDA. Mutates: logits."""
    num_masks, num_words = bitmask.shape
    vocab = logits.shape[1]
    grid = (num_masks, triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](
        logits, bitmask, rows.to(torch.int64), vocab, num_words, BLOCK=BLOCK
    )
