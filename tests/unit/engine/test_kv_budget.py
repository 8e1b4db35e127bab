"""The KV cache's budget on a GPU (`setup.cuda_kv_budget`, vLLM's meaning of
gpu_memory_utilization): the fraction of the device less what this process holds; too little
free memory (another process on the GPU) or a budget the weights already fill is one error that
says what to change, never a negative block count."""

from __future__ import annotations

import pytest

from specdec.engine.setup import GIB, cuda_kv_budget

TOTAL = 140 * GIB


def test_alone_the_budget_is_the_fraction_less_what_this_process_holds():
    held = 2 * GIB
    free = TOTAL - held - GIB // 2  # the CUDA context
    assert cuda_kv_budget(0.9, free, TOTAL, held) == pytest.approx(0.9 * TOTAL - held)
    assert cuda_kv_budget(0.5, free, TOTAL, held) == pytest.approx(0.5 * TOTAL - held)


def test_memory_held_by_another_process_is_named_with_the_utilization_that_fits():
    held = 2 * GIB
    free = TOTAL - held - 30 * GIB  # another process holds 30 GiB
    with pytest.raises(ValueError) as error:
        cuda_kv_budget(0.9, free, TOTAL, held)
    message = str(error.value)
    assert "only 108.0 GiB are free" in message
    assert "lower gpu_memory_utilization to 0.78 or less" in message
    assert cuda_kv_budget(0.78, free, TOTAL, held) <= free  # the advice fits


def test_weights_that_fill_the_budget_ask_for_a_larger_fraction():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        cuda_kv_budget(0.1, 100 * GIB, TOTAL, 20 * GIB)
