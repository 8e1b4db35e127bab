"""The CPU's row-invariant float product (`batch_invariant_linear`): every row of every row count
gets the bits it gets alone. It pads rows to a multiple of `CPU_ROW_MULTIPLE`, relying on this
machine's BLAS giving every multiple of 4 rows the same per-row bits; this test is that
assumption's guard (a BLAS that blocks otherwise fails it), with its negative control: plain
F.linear on the same rows differs for some row counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models.linear import batch_invariant_linear


def test_rows_do_not_depend_on_the_row_count() -> None:
    generator = torch.Generator().manual_seed(0)
    for cols, depth in ((96, 64), (576, 576), (200, 1536)):
        weight = torch.randn(cols, depth, generator=generator)
        bias = torch.randn(cols, generator=generator)
        x = torch.randn(300, depth, generator=generator)
        alone = torch.cat([batch_invariant_linear(x[i : i + 1], weight, bias) for i in range(300)])
        for count in [*range(1, 40), 63, 64, 65, 129, 255, 300]:
            out = batch_invariant_linear(x[:count], weight, bias)
            assert torch.equal(out, alone[:count]), (cols, depth, count)
        # [..., K] inputs keep their leading shape.
        assert torch.equal(
            batch_invariant_linear(x[:12].view(3, 4, depth), weight, bias).view(12, cols),
            alone[:12],
        )
    # Negative control: the unpadded product gives some row counts other bits.
    weight = torch.randn(576, 576, generator=generator)
    x = torch.randn(64, 576, generator=generator)
    alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(64)])
    assert any(
        not torch.equal(F.linear(x[:count], weight), alone[:count]) for count in range(2, 64)
    )
