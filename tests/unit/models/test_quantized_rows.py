"""`QuantizedRows`: an EAGLE head's draft-vocabulary rows of an 8-bit LM head multiplied in place
by `q8_linear`'s row index give the bits of the same product over a copy of the rows
(`QuantizedWeight.select_rows`), with and without the C++ extension."""

from __future__ import annotations

import pytest
import torch

from specdec.models import cpu_extension
from specdec.models.quant import QuantizedWeight
from specdec.models.quant_formats import GroupQuantized
from specdec.models.quant_rows import QuantizedRows, weight_rows

extension = cpu_extension.load_extension()
needs_extension = pytest.mark.skipif(
    extension is None, reason="the C++ extension could not be built here (see the log line)"
)


def _head(rows: int = 96, cols: int = 64) -> QuantizedWeight:
    """An 8-bit, group-32 symmetric weight kept with its source, as the tied LM head is."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    scale = torch.rand(rows, cols // 32, generator=gen) * 0.05
    source = GroupQuantized(values, scale, None, 32, (-128, 127))
    return QuantizedWeight(source, torch.device("cpu"), keep_source=True)


@needs_extension
@pytest.mark.parametrize("num_x", [1, 2, 5])
def test_rows_in_place_equal_the_copied_rows(num_x: int) -> None:
    weight = _head()
    index = torch.tensor([95, 0, 17, 17, 40, 3, 88, 1, 2, 9, 60, 61, 62, 30, 31, 4])
    rows = weight_rows(weight, index)
    assert isinstance(rows, QuantizedRows) and rows.shape == (16, 64)
    x = torch.randn(num_x, 64, generator=torch.Generator().manual_seed(num_x))
    assert torch.equal(rows.matmul(x), weight.select_rows(index).matmul(x))
    assert torch.equal(rows.matmul(x), weight.matmul(x)[:, index])  # each output its own row


@needs_extension
def test_negative_control_another_row_gives_other_bits() -> None:
    weight = _head()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    index = torch.arange(5, 21)
    shifted = torch.arange(6, 22)
    got = weight_rows(weight, index).matmul(x)
    assert not torch.equal(got, weight.select_rows(shifted).matmul(x))


def test_without_q8_linear_the_copy_is_multiplied(monkeypatch) -> None:
    weight = _head()
    index = torch.arange(50, 66)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    rows = QuantizedRows(weight, index)
    monkeypatch.setattr("specdec.models.quant_rows.q8_linear", lambda *args, **kwargs: None)
    assert torch.equal(rows.matmul(x), weight.select_rows(index).matmul(x))
    assert torch.equal(rows.dequantize(), weight.select_rows(index).dequantize())


def test_a_selection_its_copy_would_not_multiply_by_q8_linear_is_a_copy() -> None:
    weight = _head()  # 8 rows: the copy takes another layout, so the rows are copied as before
    assert not isinstance(weight_rows(weight, torch.arange(8)), QuantizedRows)


def test_bad_row_ids_are_refused() -> None:
    weight = _head()
    with pytest.raises(ValueError, match="row indices"):
        QuantizedRows(weight, torch.tensor([0, 96], dtype=torch.int64))
    if extension is not None:
        with pytest.raises(RuntimeError, match="rows"):
            extension.q8_linear(
                torch.zeros(1, 64),
                weight.source.values,
                weight.source.scale,
                32,
                torch.tensor([-1], dtype=torch.int64),
            )
