"""Quantized weights: quantizers, the CPU kernels' operands and layouts against the exact
dequantization, the kernels against `quant_linear_ref`, row selection and embedding lookups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models.gguf_blocks import BLOCK_SIZES, GGUF_QUANT_TYPES, decode_blocks
from specdec.models.quant import (
    QuantizedWeight,
    embedding_lookup,
    expand_input,
    int4_operands,
    int4_operands_dequantize,
    quant_linear,
    quant_linear_ref,
)
from specdec.models.quant_formats import (
    GroupQuantized,
    check_quantization,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the blocks")


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> GroupQuantized:
    """Random blocks of a GGUF type with realistic (small, finite) fp16 scales."""
    rng = np.random.default_rng(seed)
    values, size = BLOCK_SIZES[type_name]
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [size - 2]}
    for offset in halves[type_name]:
        field = rng.uniform(-0.02, 0.02, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8)
    return decode_blocks(blocks.reshape(-1), type_name, (rows, cols))


def _bf16_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A bound on |kernel - reference| for a bfloat16 kernel: the input rounding (x to bf16),
    the scale/zero rounding and the output rounding, each at most 2^-8 relative, summed over
    |x| |w| (float32 accumulation adds far less)."""
    return 4 * 2.0**-8 * (x.abs() @ weight.abs().t()) + 1e-6


@pytest.mark.parametrize("type_name", GGUF_QUANT_TYPES)
def test_int4_operands_reproduce_the_weight(type_name: str) -> None:
    """The kernel's operands (float32 scales, x expanded as the kernel reads it) give the same
    product as the exact dequantization, up to float32 rounding."""
    weight = _blocks(type_name, 32, 256, seed=1)
    ops = int4_operands(weight)
    assert ops is not None
    assert int(ops.nibbles.max()) <= 15
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    got = expand_input(x, ops.source_group) @ int4_operands_dequantize(ops, torch.float32).t()
    want = x @ weight.dequantize().t()
    scale = (x.abs() @ weight.dequantize().abs().t()).max()
    assert (got - want).abs().max() <= 1e-5 * scale


def test_int4_operands_refuse_what_the_kernel_cannot_take() -> None:
    weight = _blocks("Q4_0", 24, 64, seed=2)  # 24 rows: not a multiple of 16
    assert int4_operands(weight) is None
    assert QuantizedWeight(weight, "cpu").layout == "reference"


@pytest.mark.parametrize("type_name", GGUF_QUANT_TYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 17, 130])
def test_cpu_kernel_matches_reference(type_name: str, num_rows: int) -> None:
    """PyTorch's int4 kernel (every row count: a prefill chunk's too) against the exact
    product: within the bfloat16 bound, and much closer than a wrong weight."""
    weight = _blocks(type_name, 64, 256, seed=3)
    packed = QuantizedWeight(weight, "cpu")
    assert packed.layout == "cpu_int4"
    x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(num_rows))
    got = quant_linear(x, packed)
    exact = weight.dequantize()
    want = x @ exact.t()
    assert got.dtype == torch.float32 and got.shape == (num_rows, 64)
    assert ((got - want).abs() <= _bf16_bound(x, exact)).all()
    # Negative control: the same bound rejects a weight with one group's scale doubled.
    broken = exact.clone()
    broken[:, : weight.group_size] *= 2
    assert not ((x @ broken.t() - want).abs() <= _bf16_bound(x, exact)).all()


@pytest.mark.parametrize("source", ["Q4_1", "Q8_0", "int8", "fp8"])
def test_zero_rows_give_an_empty_product(source: str) -> None:
    """An eager step that wants no logits multiplies zero rows by the LM head: [0, N] back,
    whatever the layout (PyTorch's CUDA int4 kernel fails on zero rows: s34)."""
    dense = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    formats = {"int8": quantize_int8, "fp8": quantize_fp8}
    weight = formats[source](dense) if source in formats else _blocks(source, 64, 256, seed=5)
    packed = QuantizedWeight(weight, "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        out = quant_linear(torch.empty(0, 256, dtype=dtype), packed)
        assert out.shape == (0, 64) and out.dtype == dtype


@pytest.mark.parametrize("type_name", GGUF_QUANT_TYPES)
def test_dequantize_of_the_layout_is_the_weight(type_name: str) -> None:
    """`QuantizedWeight.dequantize` (bfloat16 scales, as the kernel reads them) stays within
    the scale rounding of the exact weight; the reference uses it."""
    weight = _blocks(type_name, 80, 256, seed=4)  # 80 rows: a partial packing block too
    packed = QuantizedWeight(weight, "cpu")
    exact = weight.dequantize()
    approx = packed.dequantize()
    # Unpacking is exact: the operands with bfloat16 scale and zero, collapsed.
    ops = int4_operands(weight)
    assert ops is not None
    expanded = int4_operands_dequantize(ops, torch.bfloat16)
    if ops.source_group is not None:
        parts = expanded.view(80, -1, 2, ops.source_group)
        expanded = (parts[:, :, 0] + 16 * parts[:, :, 1]).reshape(80, -1)
    assert torch.equal(approx, expanded)

    # Rounding scale and zero to bfloat16 moves a value by at most 2^-8 of |s| |q| + |z|.
    def per_value(t: torch.Tensor) -> torch.Tensor:
        return t.abs().repeat_interleave(weight.group_size, dim=1)

    zero = per_value(weight.zero) if weight.zero is not None else 0
    bound = 2.0**-8 * (300 * per_value(weight.scale) + zero) * 2
    assert ((approx - exact).abs() <= bound + 1e-7).all()
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    ref = quant_linear_ref(x, packed)
    assert torch.allclose(ref, x @ approx.t(), atol=1e-5, rtol=1e-5)


def test_int8_per_channel_uses_int8_kernel() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(6))
    quantized = quantize_int8(weight)
    packed = QuantizedWeight(quantized, "cpu")
    assert packed.layout == "cpu_int8"
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(7))
    exact = quantized.dequantize()
    got = quant_linear(x, packed)
    assert ((got - x @ exact.t()).abs() <= _bf16_bound(x, exact)).all()


def test_quantizers_error_bounds() -> None:
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(8))
    int8 = quantize_int8(weight)
    assert ((int8.dequantize() - weight).abs() <= int8.scale / 2 + 1e-7).all()
    int4 = quantize_int4(weight, 32)
    step = int4.scale.repeat_interleave(32, dim=1)
    assert int4.value_range == (0, 15) and int(int4.values.max()) <= 15
    assert ((int4.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    fp8 = quantize_fp8(weight)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 (normal range), plus subnormal spacing.
    bound = 2.0**-4 * weight.abs() + fp8.scale[:, None] * 2.0**-9
    assert ((fp8.dequantize() - weight).abs() <= bound).all()
    per_tensor = quantize_fp8(weight, per_channel=False)
    assert torch.unique(per_tensor.scale).numel() == 1


def test_fp8_reference_layout_on_cpu() -> None:
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))
    packed = QuantizedWeight(quantize_fp8(weight), "cpu")
    assert packed.layout == "reference"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10))
    assert torch.allclose(quant_linear(x, packed), quant_linear_ref(x, packed), atol=1e-5)


def test_select_rows_and_embedding_lookup() -> None:
    table = _blocks("Q8_0", 64, 128, seed=11)
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.equal(embedding_lookup(table, ids), table.dequantize()[ids])
    packed = QuantizedWeight(table, "cpu", keep_source=True)
    rows = torch.arange(0, 64, 2)
    picked = packed.select_rows(rows)
    assert picked.shape == (32, 128) and picked.layout == "cpu_int4"
    assert torch.equal(picked.dequantize(), packed.dequantize()[rows])
    with pytest.raises(ValueError, match="source"):
        QuantizedWeight(table, "cpu").select_rows(rows)


def test_quantization_names_are_checked() -> None:
    for name in (None, "gguf", "int8", "int4", "fp8"):
        check_quantization(name)
    with pytest.raises(ValueError, match="awq"):
        check_quantization("awq")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_a_kept_8bit_source_is_packed_for_the_int4_kernel_on_first_use(
    type_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symmetric 8-bit weight kept with its source (an LM head, which the C++ `q8_linear`
    multiplies by where it is built) holds no int4 tensors until PyTorch's int4 kernel needs
    them; then it holds the tensors of a weight packed at once, and gives its products and
    dequantization bit for bit. Weights `q8_linear` never takes are packed at once.

    Negative control: one value moved by one step changes the dequantization (exact float32;
    the kernel's bfloat16 products may round it away), so its equality sees a change that
    small."""
    table = _blocks(type_name, 64, 256, seed=12)
    eager = QuantizedWeight(table, "cpu")  # no source: packed at once
    lazy = QuantizedWeight(table, "cpu", keep_source=True)
    assert lazy.layout == eager.layout == "cpu_int4"
    assert "packed" not in lazy._tensors
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(14))
    monkeypatch.setattr("specdec.models.quant.q8_linear", lambda x, weight: None)  # not built
    assert torch.equal(lazy.matmul(x), eager.matmul(x))
    assert lazy._meta == eager._meta
    for name, tensor in eager._tensors.items():
        assert torch.equal(lazy._tensors[name], tensor), name
    assert torch.equal(lazy.dequantize(), eager.dequantize())
    fresh = QuantizedWeight(table, "cpu", keep_source=True)
    assert torch.equal(fresh.dequantize(), eager.dequantize())  # dequantize packs it too
    values = table.values.clone()
    values[0, 0] = values[0, 0] + (1 if values[0, 0] < 0 else -1)
    moved = GroupQuantized(values, table.scale, None, table.group_size, table.value_range)
    assert not torch.equal(QuantizedWeight(moved, "cpu").dequantize(), eager.dequantize())
    four_bit = QuantizedWeight(_blocks("Q4_1", 64, 128, seed=13), "cpu", keep_source=True)
    assert "packed" in four_bit._tensors


def test_int8_quantizer_rounds_each_row_to_its_largest_magnitude() -> None:
    """`quantize_int8` equals round(w / s) clamped to [-127, 127] with s = max |w| / 127 per
    row (floored at 1e-12), bit for bit: on random rows, rows of tiny or only negative values,
    and a zero row.

    Negative control: scales from max |w| / 127.5 differ, so the equality sees the scale."""
    g = torch.Generator().manual_seed(15)
    for weight in (
        torch.randn(96, 80, generator=g),
        torch.randn(96, 80, generator=g) * 1e-4,
        -torch.rand(96, 80, generator=g),
    ):
        weight[3] = 0.0
        got = quantize_int8(weight)
        largest = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        scale = largest / 127.0
        assert torch.equal(got.scale, scale)
        assert torch.equal(got.values, torch.round(weight / scale).clamp(-127, 127).to(torch.int8))
        assert not torch.equal(got.scale, largest / 127.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_quantizer_gives_the_same_bits_in_any_chunking_and_from_the_file_dtype(dtype) -> None:
    """`quantize_int8` a few rows at a time (chunks of 1 row, of 7 rows: a last partial chunk,
    of the whole weight) equals the whole weight at once, and a float16 / bfloat16 weight
    equals its float32 copy (the upcast is exact), bit for bit: scales compared as bytes.

    Negative control: a weight whose float32 copy is rounded to bfloat16 first gives other
    bits (a cast that is not exact shows)."""
    g = torch.Generator().manual_seed(16)
    weight = (torch.randn(45, 80, generator=g) * 0.05).to(dtype)
    weight[3] = 0.0
    whole = quantize_int8(weight.float(), chunk_values=weight.numel())
    for chunk_values in (1, 80, 7 * 80 + 5, 1 << 20):
        got = quantize_int8(weight, chunk_values=chunk_values)
        assert torch.equal(got.values, whole.values)
        assert torch.equal(got.scale.view(torch.int32), whole.scale.view(torch.int32))
        assert got.values.dtype == torch.int8 and got.scale.shape == (45, 1)
    if dtype != torch.bfloat16:
        rounded = quantize_int8(weight.float().to(torch.bfloat16))
        assert not torch.equal(rounded.scale.view(torch.int32), whole.scale.view(torch.int32))
