"""The CUDA-graph helper every graphed step uses (the target's decode/verify step and the drafters'
steps): padded batch sizes. Never samples or draws randomness.
"""

from __future__ import annotations


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})
