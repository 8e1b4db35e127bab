"""Tile sizes, and the score scaling (soft cap included), that the attention kernels and their
PyTorch twins share (a twin fixes the same reduction order, so both read one definition)."""

from __future__ import annotations

import math

import torch

# Keys per tile of the prefill kernel's online softmax (the twin's tile order).
PREFILL_BLOCK_N = 64
# Base-2 exponentials: exp(x) = 2 ** (x * LOG2E).
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)  # base-2 row maxima back to natural logs (split-KV's log-sum-exp)
# Keys per online-softmax step of the decode kernels (single-pass and split-KV alike).
DECODE_BLOCK_N = 64
# Keys per split-KV partition (a multiple of DECODE_BLOCK_N and PREFILL_BLOCK_N). Every
# attention kernel cuts a context longer than this at the same absolute edges and merges the
# partitions' partials in order (`merge_partial_ref`), so a row has the same bits from each.
SPLIT_KV_PARTITION = 2048


def split_kv_partition() -> int:
    """`SPLIT_KV_PARTITION`, read when a kernel launches or a twin runs (tests shrink it)."""
    return SPLIT_KV_PARTITION


def kernel_partition(max_keys: int) -> int:
    """The PARTITION a single-pass kernel (decode or prefill) runs with over a block table that
    holds up to `max_keys` keys: 0 (one pass, no merge) when no context can span two
    partitions, else the split-KV partition, whose edges it then merges at."""
    partition = split_kv_partition()
    return partition if max_keys > partition else 0


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap_log2): the float arguments the attention kernels (and twins) turn
    q.k products into base-2 scores with.

    Without a cap the scores are products * qk_scale, qk_scale = scale * log2(e), and
    softcap_log2 is 0.0 (unread). With one (Gemma 2: scores = cap * tanh(scale * q.k / cap)),
    tanh(x) = 1 - 2 / (e^(2x) + 1) puts the scale and the cap into qk_scale
    = 2 log2(e) scale / cap, and the base-2 scores are (1 - 2 / (2^(products * qk_scale) + 1))
    * softcap_log2, softcap_log2 = cap * log2(e) (`soft_cap_ref`); the exponential saturates to
    +-cap for large products, never NaN."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return 2.0 * LOG2E * scale / softcap, softcap * LOG2E


def soft_cap_ref(scaled: torch.Tensor, softcap_log2: float) -> torch.Tensor:
    """The kernels' soft cap on float32 products already times `score_scales`' qk_scale: the
    twins' copy of their operations, in their order."""
    return (1.0 - 2.0 / (torch.exp2(scaled) + 1.0)) * softcap_log2


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


def merge_partial_ref(
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    acc: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    part_acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One partition's partial merged into the running state of the partitions before it, as
    every attention kernel merges at each partition edge (`partition_merge_triton`).

    With M = max(m, m_p), a = 1 where m == M else 2^(m - M), b likewise for m_p: the state
    becomes (M, l a + l_p b, acc a + acc_p b); an empty state (m = -inf) takes the partial as it
    is and an empty partial leaves the state as it is, so a context of one partition keeps the
    single pass's bits. Args: [...] maxima (base-2 scores, may be -inf) and sums, [..., D]
    unnormalised outputs, all float32. Returns the merged (max, sum, acc)."""
    new_max = torch.maximum(row_max, part_max)
    safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
    mine = torch.where(row_max == new_max, 1.0, torch.exp2(row_max - safe_max))
    theirs = torch.where(part_max == new_max, 1.0, torch.exp2(part_max - safe_max))
    empty, none_new = row_max == float("-inf"), part_max == float("-inf")
    merged_sum = row_sum * mine + part_sum * theirs
    merged_acc = acc * mine[..., None] + part_acc * theirs[..., None]
    row_sum = torch.where(empty, part_sum, torch.where(none_new, row_sum, merged_sum))
    acc = torch.where(empty[..., None], part_acc, torch.where(none_new[..., None], acc, merged_acc))
    return new_max, row_sum, acc
