"""Rows of an 8-bit LM head read in place (`QuantizedRows`): an EAGLE head's draft vocabulary
in its target's tied head, multiplied through `q8_linear`'s row index instead of copied."""

from __future__ import annotations

import torch

from specdec.models.cpu_extension import q8_linear
from specdec.models.quant import QuantizedWeight


def weight_rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight | QuantizedRows:
    """The rows `rows` ([N'] int64) of `weight` for products: read in place where the weight
    takes `q8_linear` (`QuantizedRows`: no copy), else a copy (`QuantizedWeight.select_rows`)."""
    if weight.takes_q8_linear and rows.numel() % 16 == 0:  # (its copy would take q8_linear too)
        return QuantizedRows(weight, rows.to(device="cpu", dtype=torch.int64).contiguous())
    return weight.select_rows(rows)


class QuantizedRows:
    """Rows `index` of a weight that takes `q8_linear` (an 8-bit LM head kept with its source),
    multiplied in place through q8_linear's row index: the same sums as over a copy of the rows,
    so the same bits, without the copy (an EAGLE head's draft vocabulary: 10 MiB of the built-in
    model's head). Where q8_linear does not run (no extension, a bfloat16 x) the copy is made on
    first use and multiplied instead."""

    def __init__(self, weight: QuantizedWeight, index: torch.Tensor) -> None:
        if index.dim() != 1 or (
            index.numel() and not 0 <= int(index.min()) <= int(index.max()) < weight.shape[0]
        ):
            raise ValueError(f"row indices must be [N'] ids of the weight's {weight.shape[0]} rows")
        self.weight, self.index = weight, index
        self.shape = (index.shape[0], weight.shape[1])
        self._copy: QuantizedWeight | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N'] in x's dtype; see `QuantizedWeight.matmul`."""
        out = q8_linear(x, self.weight.source, self.index)
        if out is not None:
            return out
        return self.copy().matmul(x)

    def copy(self) -> QuantizedWeight:
        """The rows as a weight of their own (`QuantizedWeight.select_rows`), made once."""
        if self._copy is None:
            self._copy = self.weight.select_rows(self.index)
        return self._copy

    def dequantize(self) -> torch.Tensor:
        return self.copy().dequantize()
