"""`row_classes.eager_row_counts`: its sample holds a row count of every (linear tile tier,
Triton value class) pair that any count up to the limit falls in, and nothing past the limit."""

from __future__ import annotations

import pytest

from specdec.models.row_classes import LINEAR_ROW_TIERS, eager_row_counts


def row_class(count: int) -> tuple[int, str]:
    """(the tier `linear_tile` puts the count in, Triton's value class of the count)."""
    tier = sum(count > end for end in LINEAR_ROW_TIERS)
    value = "one" if count == 1 else "multiple of 16" if count % 16 == 0 else "other"
    return tier, value


@pytest.mark.parametrize("limit", [1, 2, 16, 17, 100, 128, 200, 512, 513, 600, 4096])
def test_every_class_up_to_the_limit_is_sampled(limit):
    sample = eager_row_counts(limit)
    assert sample == sorted(set(sample)) and all(1 <= n <= limit for n in sample)
    needed = {row_class(n) for n in range(1, limit + 1)}
    assert {row_class(n) for n in sample} == needed


def test_the_sample_is_small():
    assert eager_row_counts(10**6) == [1, 2, 16, 17, 32, 129, 144, 513, 528]
