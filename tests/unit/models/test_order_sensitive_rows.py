"""`order_sensitive_rows`, the inputs of the CUDA start-up check (`check_cublas_rows`): against a
weight of ones, two kernels that sum a row's depth in another order must give it other bits in
the rounded output, or the check could clear a kernel change (s33: the tiny model's 97 x 64 head
passed on `sin` inputs while its rows changed with the row count). Checked here with float32
sums in two orders (the CPU has no cuBLAS): the orders must disagree on most rows, and one order
must agree with itself."""

from __future__ import annotations

import pytest
import torch

from specdec.models.linear import order_sensitive_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("depth", [64, 576, 4096])
def test_two_summation_orders_give_most_rows_other_bits(dtype, depth) -> None:
    rows = 200
    x = order_sensitive_rows(rows, depth, dtype, "cpu")
    assert x.shape == (rows, depth) and x.dtype == dtype
    assert torch.equal(x, order_sensitive_rows(rows, depth, dtype, "cpu"))  # no randomness
    values = x.float()
    assert torch.isfinite(values).all()
    if dtype == torch.float16:  # partial sums stay inside float16's range whatever the order
        assert values.clamp(min=0).sum(1).max() < torch.finfo(torch.float16).max
    # A whole-row sum against the same row summed in tiles of 16, then the tiles' sums: as a
    # kernel with another depth split would.
    whole = values.sum(1)
    tiled = values.view(rows, -1, 16).sum(2).sum(1)
    assert torch.equal(whole.to(dtype), values.sum(1).to(dtype))  # one order: the same bits
    differs = (whole.to(dtype) != tiled.to(dtype)).float().mean().item()
    assert differs >= 0.8, differs


def test_negative_control_plain_inputs_hide_the_order() -> None:
    """The check's old inputs alone (`sin` of a grid against a bfloat16 weight of small values,
    the tiny head's shape) let most rows keep their bits under another summation order: the
    reason the check needs the order-sensitive problem."""
    rows, depth = 200, 64
    grid = torch.arange(rows * depth, dtype=torch.float32)
    x = torch.sin(grid * 0.618034).mul_(2.0).view(rows, depth).bfloat16().float()
    weight = (torch.cos(torch.arange(97 * depth, dtype=torch.float32)) * 0.05).view(97, depth)
    products = x[:, None, :] * weight.bfloat16().float()[None]  # [rows, 97, depth]
    whole = products.sum(-1).bfloat16()
    tiled = products.view(rows, 97, -1, 16).sum(-1).sum(-1).bfloat16()
    assert (whole != tiled).float().mean().item() < 0.05
