"""The fused decode path (the step CUDA graphs replay) against the eager forward, on the CPU
twins of its kernels: same logits, features and K/V, and padded rows write nothing."""

from __future__ import annotations

import math

import pytest
import torch

from models_fixtures import TINY_CONFIGS, compare_decode_path, seeded_model
from specdec.runner.cuda_graph import batch_buckets
from specdec.runner.model_runner import PagedModelRunner, StepInput

DECODE_CONFIGS = list(TINY_CONFIGS)  # a sliding window too: the CPU's plan has windows
# Scaled RoPE with one frequency table (dynamic NTK has one per position: eager only).
ROPE_DECODE_CONFIGS = ["llama3", "yarn_mscale", "linear"]


@pytest.mark.parametrize("name", DECODE_CONFIGS + ROPE_DECODE_CONFIGS)
def test_decode_path_matches_eager(name: str) -> None:
    compare_decode_path(name, "cpu", use_graphs=False)


def test_padded_rows_are_inert() -> None:
    """Sentinel: blocks no live sequence owns still hold NaN after padded decode steps (3 live
    sequences run as a batch of 4, each padded to 4 query tokens)."""
    runner = PagedModelRunner(
        seeded_model("llama", "cpu"),
        num_blocks=12,
        block_size=4,
        max_num_seqs=4,
        max_model_len=16,
        max_query_len=4,
        decode_path=True,
        pad_batches=True,
    )
    runner.kv_cache.k_cache.fill_(math.nan)
    runner.kv_cache.v_cache.fill_(math.nan)
    inputs = [
        StepInput([5, 6], 0, [3], 2),
        StepInput([7], 0, [8], 1),
        StepInput([9, 10, 11], 0, [1], 3),
    ]
    logits = runner.run(inputs)
    assert [tuple(t.shape) for t in logits] == [(2, 97), (1, 97), (3, 97)]
    assert all(torch.isfinite(t).all() for t in logits)
    cache = runner.kv_cache.k_cache
    written = {3: 2, 8: 1, 1: 3}
    for block in range(12):
        for slot in range(4):
            finite = bool(torch.isfinite(cache[:, block, slot]).all())
            assert finite == (slot < written.get(block, 0)), (block, slot)


def test_the_cuda_decode_path_takes_a_sliding_window() -> None:
    """CUDA's decode kernels have windows, as the CPU's plan has (the comparison above; the
    kernels: tests/unit/models/test_window_softcap_kernels.py)."""
    config = seeded_model("mistral_window", "cpu").config
    assert config.decode_path_reason("cpu") is None
    assert config.decode_path_reason("cuda") is None


def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("decode_path", [True, False])
def test_run_rows_stacks_the_logits_of_run(decode_path: bool) -> None:
    """`run_rows` (the overlapped decode step's call) gives `run`'s logits as one [B, V] tensor,
    padded to a bucket or not, and refuses inputs of several query tokens."""

    def runner() -> PagedModelRunner:
        return PagedModelRunner(
            seeded_model("llama", "cpu"),
            num_blocks=12,
            block_size=4,
            max_num_seqs=4,
            max_model_len=16,
            decode_path=decode_path,
            pad_batches=decode_path,
        )

    inputs = [StepInput([5], 0, [3], 1), StepInput([7], 0, [8], 1), StepInput([9], 0, [1], 1)]
    first = torch.tensor([11, 12, 13])
    expected = torch.cat(runner().run(inputs, first))
    rows = runner().run_rows(inputs, first)
    assert rows.shape == (3, 97)
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one query token"):
        runner().run_rows([StepInput([5, 6], 0, [3], 2)])


def test_decode_path_refuses_dynamic_rope() -> None:
    with pytest.raises(ValueError, match="dynamic NTK"):
        PagedModelRunner(seeded_model("dynamic", "cpu"), 8, 4, max_num_seqs=4, decode_path=True)
    # Left to choose, a dynamic-rope model runs eagerly.
    assert PagedModelRunner(seeded_model("dynamic", "cpu"), 8, 4, max_num_seqs=4).graphs is None
