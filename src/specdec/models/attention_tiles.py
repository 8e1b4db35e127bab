"""Tile sizes that the attention kernels and their PyTorch twins share (a twin fixes the same
reduction order, so both read one definition)."""

from __future__ import annotations

import math

# Keys per tile of the prefill kernel's online softmax (the twin's tile order).
PREFILL_BLOCK_N = 64
# Base-2 exponentials: exp(x) = 2 ** (x * LOG2E).
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)  # base-2 row maxima back to natural logs (split-KV's log-sum-exp)
# Keys per online-softmax step of the decode kernels (single-pass and split-KV alike).
DECODE_BLOCK_N = 64
# Keys per split-KV partition (a multiple of DECODE_BLOCK_N).
SPLIT_KV_PARTITION = 2048


def decode_block_m(query_per_seq: int, group: int) -> int:
    """Query rows (query token x q head of a KV head's group) per program of the decode kernels
    (single-pass and split-KV alike): the next power of two of query_per_seq * group, at least
    16 (`tl.dot`'s smallest tile)."""
    return max(16, 1 << (query_per_seq * group - 1).bit_length())


def decode_query_bucket(query_per_seq: int, group: int, limit: int) -> int:
    """The widest layout of at most `limit` (and at least `query_per_seq`) query tokens per
    sequence that the decode kernels tile as they tile `query_per_seq` (the same BLOCK_M).

    The kernels take the width as a constexpr (Q_PER_SEQ), so every width compiles a variant of
    its own; padded to its bucket, a step runs one of a few variants whose tile, and hence the
    bits of every live row, are those of its own width. Used by steps whose width follows the
    data (the EAGLE head's eager catch-up after plain-arm steps)."""
    if query_per_seq >= limit:
        return query_per_seq
    return max(query_per_seq, min(limit, decode_block_m(query_per_seq, group) // group))


# NO_FP_FUSION: the attention kernels (prefill, decode, split-KV) launch with
# enable_fp_fusion=False. Their online-softmax step is one formula, but with contraction on,
# the compiler fuses a multiply into the next add (an FMA, one rounding fewer) in some kernels'
# layouts and not in others', and a token's row then differs in its last bits between the
# prefill kernel and the decode kernel (seen on the H200 at head_dim 128).
