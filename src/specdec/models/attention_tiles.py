"""Tile sizes that the attention kernels and their PyTorch twins share (a twin fixes the same
reduction order, so both read one definition)."""

from __future__ import annotations

import math

# Keys per tile of the prefill kernel's online softmax (the twin's tile order).
PREFILL_BLOCK_N = 64
# Base-2 exponentials: exp(x) = 2 ** (x * LOG2E).
LOG2E = 1.0 / math.log(2.0)
# Keys per online-softmax step of the decode kernels (single-pass and split-KV alike).
DECODE_BLOCK_N = 64
# Keys per split-KV partition (a multiple of DECODE_BLOCK_N).
SPLIT_KV_PARTITION = 2048
