"""The CPU's row-invariant float product (`batch_invariant_linear`): every row of every row count
gets the bits it gets alone. It runs rows in chunks of `CPU_ROW_CHUNK` (one F.linear each),
relying on this machine's BLAS giving a row the same bits at every position of a chunk, which
`cpu_rows_invariant` checks per shape; this test is that check's guard on the machine that runs
it, on the chunked path itself (the check passing is asserted), with its negative control:
plain F.linear on the same rows differs for some row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.linear import batch_invariant_linear, cpu_rows_invariant


def test_rows_do_not_depend_on_the_row_count() -> None:
    generator = torch.Generator().manual_seed(0)
    # SmolLM2's shapes beside small ones: on a 2-core Intel Xeon (MKL) 1536 x 576 and 576 x 1536
    # were the shapes where multiples of 4 rows stopped sharing a kernel.
    for cols, depth in ((96, 64), (576, 576), (200, 1536), (1536, 576), (576, 1536)):
        weight = torch.randn(cols, depth, generator=generator)
        assert cpu_rows_invariant(weight), (cols, depth)  # the chunked path, not the fallback
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


def test_the_chunk_check_fails_a_position_dependent_product(monkeypatch) -> None:
    """Negative control of `cpu_rows_invariant`: a batched product whose rows depend on their
    position in the chunk (an ulp added to the chunk's later rows) is refused, and the product
    then runs one row at a time (still every row's bits alone)."""
    from specdec.models import linear as linear_module

    real_linear = F.linear

    def position_dependent(x, weight, bias=None):
        out = real_linear(x, weight, bias)
        if out.shape[0] > 1:
            out[1:] = torch.nextafter(out[1:], torch.full_like(out[1:], float("inf")))
        return out

    monkeypatch.setattr(linear_module, "_CPU_CHUNK_OK", {})
    monkeypatch.setattr(linear_module.F, "linear", position_dependent)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=generator)
    assert not cpu_rows_invariant(weight)
    x = torch.randn(20, 24, generator=generator)
    alone = torch.cat([batch_invariant_linear(x[i : i + 1], weight) for i in range(20)])
    assert torch.equal(batch_invariant_linear(x, weight), alone)


def test_float32_output_is_the_widened_product_on_the_cpu() -> None:
    """out_dtype float32 (the MoE router's): on the CPU exactly the product of the widened x and
    weight; any other out_dtype is refused by name."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=generator).bfloat16()
    weight = torch.randn(8, 64, generator=generator).bfloat16()
    got = batch_invariant_linear(x, weight, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, batch_invariant_linear(x.float(), weight.float()))
    with pytest.raises(ValueError, match=r"out_dtype torch\.float16"):
        batch_invariant_linear(x, weight, out_dtype=torch.float16)
