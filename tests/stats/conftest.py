"""Statistical tests run on one torch thread: their tensors are small, and on a busy machine two
OpenMP threads spin-waiting for each other make them an order of magnitude slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
