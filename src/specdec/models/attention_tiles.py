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


# The most query rows a decode-kernel program takes. Wider tiles compile to another matrix
# instruction on Hopper (Triton's rule: wgmma from 64 rows, mma below; not checked in the SASS),
# whose float32 sums of the same products can round differently: on the H200 a decode row of the
# built-in SmolLM2 computed in a 16-token graphed-prefill step (48 rows: one 64-row tile)
# differed from the same row alone (16 rows), and seeded requests did not replay (s22). Rows past
# this many take further programs.
DECODE_MAX_BLOCK_M = 32


def decode_block_m(query_per_seq: int, group: int) -> int:
    """Query rows (query token x q head of a KV head's group) per program of the decode kernels
    (single-pass and split-KV alike): the next power of two of query_per_seq * group, at least
    16 (`tl.dot`'s smallest tile) and at most DECODE_MAX_BLOCK_M."""
    return min(DECODE_MAX_BLOCK_M, max(16, 1 << (query_per_seq * group - 1).bit_length()))


def decode_row_tiles(query_per_seq: int, group: int) -> int:
    """Programs per (sequence, KV head) of the decode kernels: the query_per_seq * group rows in
    tiles of `decode_block_m` rows."""
    return -(-(query_per_seq * group) // decode_block_m(query_per_seq, group))


def decode_query_bucket(query_per_seq: int, group: int, limit: int) -> int:
    """The widest layout of at most `limit` (and at least `query_per_seq`) query tokens per
    sequence that the decode kernels tile as they tile `query_per_seq` (the same BLOCK_M).

    The kernels take the width as a constexpr (Q_PER_SEQ), so every width compiles a variant of
    its own; padded to its bucket, a step runs one of a few variants whose tile, and hence the
    bits of every live row, are those of its own width. Used by steps whose width follows the
    data (the EAGLE head's eager catch-up after plain-arm steps)."""
    if query_per_seq >= limit:
        return query_per_seq
    if decode_block_m(query_per_seq, group) == DECODE_MAX_BLOCK_M:  # every wider width too
        return limit
    return max(query_per_seq, min(limit, decode_block_m(query_per_seq, group) // group))


# NO_FP_FUSION: the attention kernels (prefill, decode, split-KV) launch with
# enable_fp_fusion=False. Their online-softmax step is one formula, but with contraction on,
# the compiler fuses a multiply into the next add (an FMA, one rounding fewer) in some kernels'
# layouts and not in others', and a token's row then differs in its last bits between the
# prefill kernel and the decode kernel (seen on the H200 at head_dim 128).
