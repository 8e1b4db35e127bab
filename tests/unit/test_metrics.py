"""Spec-decode statistics follow vLLM's definitions."""

import pytest

from specdec.metrics import SpecDecodeStats


def test_definitions_match_vllm():
    stats = SpecDecodeStats()
    stats.observe(4, 2)  # accepted positions 0, 1
    stats.observe(4, 4)
    stats.observe(4, 0)
    stats.observe(0, 0)  # a round without drafts is not a draft
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 12
    assert stats.num_accepted_tokens == 6
    assert stats.accepted_per_position == [2, 2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 3)
    assert stats.acceptance_rate == pytest.approx(6 / 12)
    assert stats.acceptance_per_position == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])


def test_merge_adds_counters_and_widens_positions():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.observe(2, 1)
    b.observe(5, 5)
    a.merge(b)
    assert a.num_drafts == 2 and a.num_accepted_tokens == 6
    assert a.accepted_per_position == [2, 1, 1, 1, 1]


def test_rejects_more_accepted_than_drafted():
    with pytest.raises(ValueError, match="accepted"):
        SpecDecodeStats().observe(2, 3)


def test_empty_stats_are_neutral():
    stats = SpecDecodeStats()
    assert stats.mean_acceptance_length == 1.0
    assert stats.acceptance_rate == 0.0
