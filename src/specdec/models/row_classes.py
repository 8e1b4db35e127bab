"""The row counts at which the eager kernels change variant, and a sample of each class for the
warm-up (`engine.warm_up`, `EagleDrafter.warm_up`).

Triton compiles a kernel again for each value class of a specialised integer argument (1, a
multiple of 16, anything else) and `linear_triton.linear_tile` picks its tile (a constexpr) by
row tier, so an eager step over a row count of a class or tier not seen before stalls on a
compile (0.3-0.7 s on the H200; the server's first c = 16 level compiled three `_linear_kernel`
variants for the eager prefill and the EAGLE head's prompt catch-up, s28). Running one step at
a sample of every (tier, class) at start-up compiles them all.
"""

from __future__ import annotations

# The last row count of each of `linear_tile`'s tiers but the open one above them.
LINEAR_ROW_TIERS = (16, 128, 512)


def eager_row_counts(limit: int) -> list[int]:
    """Row counts of at most `limit`: in each of `linear_tile`'s tiers (LINEAR_ROW_TIERS, and
    the open one above them), the first count of each value class it holds (1 in the first
    tier; the first other count; the first multiple of 16): 1, 2, 16, then 17 and 32, 129 and
    144, 513 and 528."""
    counts = []
    for low, high in zip((0, *LINEAR_ROW_TIERS), (*LINEAR_ROW_TIERS, None), strict=True):
        top = limit if high is None else min(high, limit)
        other = low + 1 if (low + 1) % 16 and low + 1 != 1 else low + 2
        for count in (1 if low == 0 else None, other, (low // 16 + 1) * 16):
            if count is not None and low < count <= top:
                counts.append(count)
    return sorted(set(counts))
