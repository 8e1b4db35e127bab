"""The merge of split-KV partitions' partials in Triton, shared by every attention kernel that
attends past one partition (single-pass decode, split-KV's second pass, prefill): one
definition, so their rows keep the same bits. Imports nothing of the models' attention code
(the kernels' modules import it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_partial_triton(row_max, row_sum, acc, part_max, part_sum, part_acc):
    """A partition's partial (part_max, part_sum, part_acc) merged into the running state of the
    partitions before it (`split_kv.merge_partial_ref`, operation for operation): the split-KV
    second pass, and the single-pass and prefill kernels at each partition edge. An empty state
    takes the partial as it is, so one partition keeps the single pass's bits."""
    new_max = tl.maximum(row_max, part_max)
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    mine = tl.where(row_max == new_max, 1.0, tl.math.exp2(row_max - safe_max))
    theirs = tl.where(part_max == new_max, 1.0, tl.math.exp2(part_max - safe_max))
    empty = row_max == float("-inf")
    none_new = part_max == float("-inf")
    merged_sum = row_sum * mine + part_sum * theirs
    merged_acc = acc * mine[:, None] + part_acc * theirs[:, None]
    row_sum = tl.where(empty, part_sum, tl.where(none_new, row_sum, merged_sum))
    acc = tl.where(empty[:, None], part_acc, tl.where(none_new[:, None], acc, merged_acc))
    return new_max, row_sum, acc
