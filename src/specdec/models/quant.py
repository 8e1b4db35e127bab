"""Weights that stay quantized: the layouts their kernels read, and the matmul dispatch (the
formats, `GroupQuantized` and `Fp8Quantized`, and the quantizers of float weights are
`quant_formats.py`'s).

`QuantizedWeight` holds one weight in the layout its kernel reads: on the CPU PyTorch's
weight-only kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`, which compute in
bfloat16), on CUDA the Triton kernels of `quant_triton.py`. `quant_linear_ref` multiplies by the
exact dequantization and is the twin those kernels are tested against. Nothing here reads files
or draws randomness.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from specdec.models.cpu_extension import q8_linear
from specdec.models.linear import batch_invariant_linear
from specdec.models.quant_formats import (
    Fp8Quantized,
    GroupQuantized,
    Quantized,
)

# Every product takes the weight-only kernel, on the CPU and on CUDA, whose rows do not depend
# on how many rows it multiplies: a dequantized GEMM for prefill chunks (faster from a few tens
# of rows on) rounds differently, so a request's tokens would depend on what shares its chunk,
# whether a step mixes prefill and decode rows, and on preemption. (Until s34 CUDA steps of 256
# rows or more outside the decode path's kernels, and an LM head over 256 rows or more,
# dequantized for one GEMM.)
KERNEL_DTYPE_CPU = torch.bfloat16  # what PyTorch's CPU weight-only kernels compute in


# --------------------------------------------------------------------------- CPU layouts
@functools.cache
def _cpu_int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


@functools.cache
def _cuda_int4_available() -> bool:
    """Whether PyTorch's CUDA int4 weight-only kernel (tinygemm) runs on this GPU."""
    try:
        nibbles = torch.zeros(16, 64, dtype=torch.uint8, device="cuda")
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, 8)
        scale_zero = torch.ones(1, 16, 2, dtype=torch.bfloat16, device="cuda")
        x = torch.ones(1, 128, dtype=torch.bfloat16, device="cuda")
        torch.ops.aten._weight_int4pack_mm(x, packed, 128, scale_zero)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


@functools.cache
def _cpu_int8_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass(frozen=True, slots=True)
class Int4Operands:
    """A group-quantized weight as PyTorch's CPU int4 kernel reads it (before packing):
    w'[n, k'] = (nibbles[n, k'] - 8) * scale[n, k' // 32-group] + zero[...], over an expanded
    input x'. Weights of more than 16 levels split each value u = 16 h + l into two nibbles
    placed side by side, group by group: x' = [x_g, 16 x_g] for each source group g.

    Attributes:
        nibbles: [N, K'] uint8 in [0, 15].
        scale, zero: [N, K' / group_size] float32.
        group_size: the kernel's group size (32, 64, 128 or 256).
        source_group: the source group size g when split (x is expanded), else None.
    """

    nibbles: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    source_group: int | None


def int4_operands(weight: GroupQuantized) -> Int4Operands | None:
    """The CPU int4 kernel's operands for `weight`, or None when the kernel cannot take it
    (N not a multiple of 16, a group size it has no variant for).

    Exact in real arithmetic: sum_k' x'[k'] w'[n, k'] = sum_k x[k] w[n, k]; the kernel then
    rounds scale and zero to bfloat16.
    """
    num_rows, num_cols = weight.shape
    low, high = weight.value_range
    group = weight.group_size
    if num_rows % 16 or high - low > 255:
        return None
    zero = weight.zero if weight.zero is not None else torch.zeros_like(weight.scale)
    scale = weight.scale
    unsigned = _unsigned(weight.values, low)  # [N, K] uint8 in [0, high - low]
    if high - low < 16:  # 4-bit: (u - 8) s + (zero + (low + 8) s) = (u + low) s + zero
        if group not in (32, 64, 128, 256):
            return None
        return Int4Operands(unsigned, scale, zero + (low + 8) * scale, group, None)
    # 8-bit: u = 16 h + l; per source group, [l .. | h ..] against [x_g | 16 x_g].
    groups = num_cols // group
    low_nibbles = (unsigned & 15).view(num_rows, groups, 1, group)
    high_nibbles = (unsigned >> 4).view(num_rows, groups, 1, group)
    nibbles = torch.cat([low_nibbles, high_nibbles], dim=2).view(num_rows, 2 * num_cols)
    if group % 32 == 0 and group <= 256:
        # Two kernel groups per source group: l with zero + (low + 8) s, h with 8 s.
        low_zero = zero + (low + 8) * scale
        split_scale = torch.stack([scale, scale], dim=2).view(num_rows, 2 * groups)
        split_zero = torch.stack([low_zero, 8 * scale], dim=2).view(num_rows, 2 * groups)
        return Int4Operands(nibbles, split_scale, split_zero, group, group)
    if group == 16:
        # One kernel group of 32 holds l and h of a source group and shares one zero z:
        # s sum x (l + 16 h) + (17 z - 136 s) sum x must equal s sum x (l + 16 h) + (low s + zero)
        # sum x, so z = (136 s + low s + zero) / 17.
        return Int4Operands(nibbles, scale, (136 * scale + low * scale + zero) / 17, 32, 16)
    return None


def _unsigned(values: torch.Tensor, low: int) -> torch.Tensor:
    """int8 values - low as uint8 (no wider intermediate: v - low fits a byte)."""
    if low == 0:
        return values.view(torch.uint8)
    if low == -128:  # v + 128 flips the sign bit
        return values.view(torch.uint8) ^ 0x80
    return (values.to(torch.int16) - low).to(torch.uint8)


def expand_input(x: torch.Tensor, source_group: int | None) -> torch.Tensor:
    """x' of `Int4Operands`: [M, K] -> [M, 2K] ([x_g, 16 x_g] per group), or x itself."""
    if source_group is None:
        return x
    num_rows, num_cols = x.shape
    grouped = x.view(num_rows, num_cols // source_group, 1, source_group)
    # (16 x is exact; no constant tensor is made, so CUDA graphs capture this)
    return torch.cat([grouped, grouped * 16], dim=2).view(num_rows, 2 * num_cols)


def int4_operands_dequantize(ops: Int4Operands, dtype: torch.dtype) -> torch.Tensor:
    """[N, K'] w' in float32 with scale and zero rounded to `dtype` as the kernel reads them."""
    num_rows, num_cols = ops.nibbles.shape
    groups = num_cols // ops.group_size
    scale = ops.scale.to(dtype).to(torch.float32)[:, :, None]
    zero = ops.zero.to(dtype).to(torch.float32)[:, :, None]
    values = ops.nibbles.to(torch.float32).view(num_rows, groups, ops.group_size) - 8
    return (values * scale + zero).view(num_rows, num_cols)


@functools.cache
def _int4_pack_block() -> int | None:
    """Rows per block of PyTorch's CPU int4 packing on this machine (64 with AVX-512, 32 with
    AVX2), found by packing with PyTorch's converter and checking `_pack_cpu_int4` and
    `_unpack_cpu_int4` against it (whole blocks and a partial one); None if the layout is not
    the one they know (then PyTorch's converter packs, the kernel alone reads the weight:
    prefill chunks use the int4 kernel too and `dequantize` is unavailable)."""
    if not _cpu_int4_available():
        return None
    for block in (64, 32):
        good = True
        for num_rows in (2 * block, block + 16):
            rows = torch.arange(num_rows)[:, None]
            cols = torch.arange(64)[None, :]
            nibbles = ((rows * 37 + cols * 11 + rows * cols % 7) % 16).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
            unsigned = nibbles.to(torch.uint8)
            good = (
                good
                and torch.equal(_pack_cpu_int4(unsigned, block).view(packed.shape), packed)
                and torch.equal(_unpack_cpu_int4(packed, num_rows, 64, block), unsigned)
            )
        if good:
            return block
    return None


def _pack_cpu_int4(nibbles: torch.Tensor, block: int) -> torch.Tensor:
    """`_convert_weight_to_int4pack_for_cpu` in byte operations: [N, K'] uint8 nibbles ->
    [N, K'/2] uint8 (the layout `_unpack_cpu_int4` reads)."""
    num_rows, num_cols = nibbles.shape
    whole = num_rows // block * block
    parts = []
    if whole:
        blocks = nibbles[:whole].view(whole // block, block, num_cols).transpose(1, 2)
        half = block // 2  # [NB, K', block] -> low nibble rows 0..half-1, high the rest
        parts.append((blocks[..., :half] | (blocks[..., half:] << 4)).reshape(-1))
    if num_rows > whole:
        tail = nibbles[whole:].t()  # [K', tail]: rows (2i, 2i + 1) share a byte
        parts.append((tail[:, 0::2] | (tail[:, 1::2] << 4)).reshape(-1))
    return torch.cat(parts).view(num_rows, num_cols // 2)


def _unpack_cpu_int4(packed: torch.Tensor, num_rows: int, num_cols: int, block: int):
    """Inverse of `_convert_weight_to_int4pack_for_cpu`: [N, K'/2] uint8 -> [N, K'] nibbles.
    Whole blocks of `block` rows hold per column [block / 2] bytes, low nibbles rows
    0 .. block/2 - 1, high nibbles the rest; a last, partial block pairs rows (2i, 2i + 1) in
    one byte (low, high)."""
    flat = packed.reshape(-1)
    whole = num_rows // block * block
    parts = []
    if whole:
        blocks = flat[: whole * num_cols // 2].view(whole // block, num_cols, block // 2)
        nibbles = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [NB, K', block]
        parts.append(nibbles.transpose(1, 2).reshape(whole, num_cols))
    tail = num_rows - whole
    if tail:
        pairs = flat[whole * num_cols // 2 :].view(num_cols, tail // 2)
        nibbles = torch.stack([pairs & 15, pairs >> 4], dim=-1).view(num_cols, tail)
        parts.append(nibbles.t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


# --------------------------------------------------------------------------- kernel layouts
Layout = Literal["cpu_int4", "cpu_int8", "triton_int", "triton_fp8", "reference"]


class QuantizedWeight:
    """A quantized [N, K] weight in the layout of the kernel that multiplies by it.

    Layouts: "cpu_int4" (PyTorch's packed int4, bfloat16 scale/zero pairs), "cpu_int8"
    (per-channel int8, bfloat16 scales), "triton_int" / "triton_fp8" (CUDA: the source tensors
    on the device, read by `quant_triton.py`), "reference" (dequantized per call: for shapes no
    kernel takes). `source` (the format's own tensors) is kept when asked, for row selection.
    A symmetric 8-bit "cpu_int4" weight kept with its source (an LM head: `q8_linear`
    multiplies by the source where the C++ extension is built) is packed on first use.
    """

    def __init__(
        self,
        quantized: Quantized,
        device: torch.device | str,
        *,
        keep_source: bool = False,
        layout: Layout | None = None,
    ) -> None:
        """Packs `quantized` for `device`.

        Args:
            quantized: the weight in its format (on any device).
            device: where the kernel runs.
            keep_source: keep `quantized` (on the device) for `select_rows`.
            layout: force a layout (tests); default: the fastest the device has for it.
        """
        device = torch.device(device)
        self.shape: tuple[int, int] = quantized.shape
        self.device = device
        self.source: Quantized | None = None
        self.layout: Layout = layout or _default_layout(quantized, device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._meta: dict[str, int | None] = {}
        # `q8_linear` multiplies by the source (checked once: the decode step asks every step)
        self._q8_source = self.layout == "cpu_int4" and keep_source and _q8_linear_takes(quantized)
        if self.layout == "cpu_int4":
            assert isinstance(quantized, GroupQuantized)
            if not self._q8_source:
                self._pack_cpu_int4(quantized)
            # else packed on first use by the int4 kernel (`_cpu_int4_tensors`): `q8_linear`
            # multiplies by the source, and without the C++ extension nothing else reads them
        elif self.layout == "cpu_int8":
            assert isinstance(quantized, GroupQuantized)
            self._tensors["values"] = quantized.values.contiguous()
            self._tensors["scale"] = quantized.scale.view(-1).to(KERNEL_DTYPE_CPU)
        elif self.layout == "triton_int":
            assert isinstance(quantized, GroupQuantized)
            low = quantized.value_range[0]
            if quantized.bits == 4:  # two values a byte: column 2j low, 2j + 1 high
                unsigned = (quantized.values.to(torch.int16) - low).to(torch.uint8)
                data = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
            else:
                low, data = 0, quantized.values
            self._tensors["data"] = data.contiguous().to(device)
            self._tensors["scale"] = quantized.scale.contiguous().to(device)
            if quantized.zero is not None:
                self._tensors["zero"] = quantized.zero.contiguous().to(device)
            self._meta = {
                "bits": quantized.bits,
                "group_size": quantized.group_size,
                "value_low": low,
            }
            self._pack_cuda_int4(quantized)
        elif self.layout == "triton_fp8":
            assert isinstance(quantized, Fp8Quantized)
            self._tensors["values"] = quantized.values.contiguous().to(device)
            self._tensors["scale"] = quantized.scale.contiguous().to(device)
            self._meta = {"bits": 0}
        elif self.layout == "reference":
            keep_source = True  # the source is what this layout multiplies by
        if keep_source:  # on the host beside a device layout (only `select_rows` reads it)
            self.source = quantized.to(device if self.layout == "reference" else "cpu")

    def _pack_cpu_int4(self, quantized: GroupQuantized, rows_per_chunk: int = 4096) -> None:
        """The cpu_int4 tensors, a few thousand rows (whole packing blocks) at a time: the
        operands of a whole LM head would take several bytes per value at once."""
        num_rows = quantized.shape[0]
        packed = scale_zero = None
        meta: dict[str, int | None] = {}
        for start in range(0, num_rows, rows_per_chunk):
            stop = min(start + rows_per_chunk, num_rows)
            ops = int4_operands(quantized.map_rows(lambda t, a=start, b=stop: t[a:b]))
            if ops is None:
                raise ValueError(f"the CPU int4 kernel cannot take this weight {self.shape}")
            if packed is None or scale_zero is None:
                cols, groups = ops.nibbles.shape[1], ops.scale.shape[1]
                packed = torch.empty(num_rows, cols // 2, dtype=torch.uint8)
                scale_zero = torch.empty(groups, num_rows, 2, dtype=KERNEL_DTYPE_CPU)
                meta = {
                    "group_size": ops.group_size,
                    "source_group": ops.source_group,
                    "expanded_cols": cols,
                }
            packed[start:stop] = _pack_int4_rows(ops.nibbles)
            scale_zero[:, start:stop, 0] = ops.scale.t()
            scale_zero[:, start:stop, 1] = ops.zero.t()
        assert packed is not None and scale_zero is not None
        self._tensors["packed"], self._tensors["scale_zero"] = packed, scale_zero  # [G', N, 2]
        self._meta = meta

    def _cpu_int4_tensors(self) -> dict[str, torch.Tensor]:
        """The cpu_int4 tensors ("packed", "scale_zero"; `_meta` set), packed from the source
        now if they were left for first use."""
        if "packed" not in self._tensors:
            assert isinstance(self.source, GroupQuantized)
            self._pack_cpu_int4(self.source)
        return self._tensors

    def _pack_cuda_int4(self, quantized: GroupQuantized) -> None:
        """Beside the triton_int tensors (which the prefill's dequantization reads), PyTorch's
        CUDA int4 kernel's operands when it takes the weight: the same `int4_operands` as the
        CPU's kernel, packed two nibbles a byte (even column high) and converted to its tiled
        layout; scale and zero rounded to bfloat16 ([G', N, 2]). Measured on the H200 for the
        8B shapes at one row: 0.5-0.65x the bfloat16 product, against 30-500x for the Triton
        kernel on 4-bit weights (benchmarks/probes/probe_quant_kernels.py)."""
        if not _cuda_int4_available():
            return
        group = quantized.group_size
        if group > 256 and group % 256 == 0:  # per channel: the same scale over groups of 256
            reps = group // 256
            zero = quantized.zero
            quantized = GroupQuantized(
                quantized.values,
                quantized.scale.repeat_interleave(reps, dim=1),
                None if zero is None else zero.repeat_interleave(reps, dim=1),
                256,
                quantized.value_range,
            )
        ops = int4_operands(quantized)
        if ops is None or ops.nibbles.shape[1] % 128:
            return
        nibbles = ops.nibbles.to(self.device)
        packed = ((nibbles[:, ::2] << 4) | nibbles[:, 1::2]).contiguous()
        self._tensors["int4pack"] = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        scale_zero = torch.stack([ops.scale, ops.zero], dim=2).transpose(0, 1)
        self._tensors["int4pack_scale_zero"] = scale_zero.contiguous().to(
            self.device, torch.bfloat16
        )
        self._meta["int4pack_group"] = ops.group_size
        self._meta["source_group"] = ops.source_group

    # ------------------------------------------------------------------ introspection
    @property
    def nbytes(self) -> int:
        """Bytes held on the device (kernel tensors and the source, if kept)."""
        total = sum(t.numel() * t.element_size() for t in self._tensors.values())
        if self.source is not None:
            src = self.source
            tensors = [src.values, src.scale]
            if isinstance(src, GroupQuantized) and src.zero is not None:
                tensors.append(src.zero)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    @property
    def takes_q8_linear(self) -> bool:
        """Whether products take `q8_linear` over the kept 8-bit source (an LM head) where it
        is built (`quant_rows.QuantizedRows` reads its rows in place)."""
        return self._q8_source

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """A weight of the rows `rows` ([N'] int64) only, in the same layout.

        Raises: ValueError when the source was not kept."""
        if self.source is None:
            raise ValueError("this quantized weight was packed without its source rows")
        index = rows.to(self.source.values.device)
        return QuantizedWeight(
            self.source.map_rows(lambda t: t.index_select(0, index)),
            self.device,
            keep_source=True,
            layout=self.layout if self.layout != "cpu_int4" or index.numel() % 16 == 0 else None,
        )

    # ------------------------------------------------------------------ reference
    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weight this layout multiplies by (for "cpu_int4"/"cpu_int8",
        with the bfloat16 scales the kernel reads; the source's exact dequantization
        otherwise)."""
        if self.layout == "cpu_int8":
            values = self._tensors["values"].to(torch.float32)
            return values * self._tensors["scale"].to(torch.float32)[:, None]
        if self.layout == "cpu_int4":
            self._cpu_int4_tensors()
            expanded = self._unpacked_dequantize(torch.float32)  # [N, K']
            group = self._meta["source_group"]
            if group is None:
                return expanded
            num_rows = expanded.shape[0]
            parts = expanded.view(num_rows, -1, 2, group)
            return (parts[:, :, 0] + 16 * parts[:, :, 1]).reshape(num_rows, -1)
        if self.layout == "triton_int":
            return self._device_source().dequantize()
        if self.layout == "triton_fp8":
            return Fp8Quantized(self._tensors["values"], self._tensors["scale"]).dequantize()
        assert self.source is not None
        return self.source.dequantize()

    def _device_source(self) -> GroupQuantized:
        """The triton_int tensors read back as a GroupQuantized (same values, on the device)."""
        data = self._tensors["data"]
        low = self._meta["value_low"]
        assert low is not None
        num_rows, num_cols = self.shape
        if self._meta["bits"] == 4:
            pairs = torch.stack([data & 15, data >> 4], dim=-1).view(num_rows, num_cols)
            values = (pairs.to(torch.int16) + low).to(torch.int8)
        else:
            values = data
        group = self._meta["group_size"]
        assert group is not None
        value_range = (low, low + 15) if self._meta["bits"] == 4 else (-128, 127)
        return GroupQuantized(
            values, self._tensors["scale"], self._tensors.get("zero"), group, value_range
        )

    def _unpacked_dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K'] w' of the cpu_int4 layout (expanded columns) in `dtype`."""
        block = _int4_pack_block()
        num_rows = self.shape[0]
        tensors = self._cpu_int4_tensors()
        cols = self._meta["expanded_cols"]
        assert cols is not None
        if block is None:
            raise RuntimeError("cannot unpack PyTorch's int4 layout on this machine")
        nibbles = _unpack_cpu_int4(tensors["packed"], num_rows, cols, block)
        group = self._meta["group_size"]
        assert group is not None
        scale_zero = tensors["scale_zero"].transpose(0, 1)  # [N, G', 2]
        # In place: one [N, K'] buffer.
        values = nibbles.to(dtype).view(num_rows, cols // group, group).sub_(8)
        values.mul_(scale_zero[:, :, 0:1].to(dtype)).add_(scale_zero[:, :, 1:2].to(dtype))
        return values.view(num_rows, cols)

    # ------------------------------------------------------------------ kernels
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N] in x's dtype; see `quant_linear`."""
        if x.shape[0] == 0:  # (an eager step that wants no logits: PyTorch's CUDA int4 kernel
            # fails on zero rows with "invalid argument", s34)
            return x.new_empty((0, self.shape[0]))
        layout = self.layout
        if self._q8_source:
            # An 8-bit weight kept with its source (an LM head): one pass in C++ where built.
            out = q8_linear(x, self.source)
            if out is not None:
                return out
        if layout == "cpu_int4":
            tensors = self._cpu_int4_tensors()
            xk = x if x.dtype == KERNEL_DTYPE_CPU else x.to(KERNEL_DTYPE_CPU)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                expand_input(xk, self._meta["source_group"]),
                tensors["packed"],
                self._meta["group_size"],
                tensors["scale_zero"],
            )
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if layout == "cpu_int8":
            xk = x if x.dtype == KERNEL_DTYPE_CPU else x.to(KERNEL_DTYPE_CPU)
            out = torch.ops.aten._weight_int8pack_mm(
                xk, self._tensors["values"], self._tensors["scale"]
            )
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if layout in ("triton_int", "triton_fp8"):
            from specdec.models import quant_triton

            if "int4pack" in self._tensors:
                xk = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
                out = torch.ops.aten._weight_int4pack_mm(
                    expand_input(xk, self._meta["source_group"]),
                    self._tensors["int4pack"],
                    self._meta["int4pack_group"],
                    self._tensors["int4pack_scale_zero"],
                )
                return out if out.dtype == x.dtype else out.to(x.dtype)
            return quant_triton.quant_matmul_triton(x, self._tensors, self._meta, self.shape)
        weight = self.dequantize().to(x.dtype)
        return batch_invariant_linear(x, weight)


def _q8_linear_takes(weight: Quantized) -> bool:
    """Whether `cpu_extension.q8_linear` may multiply by `weight` (symmetric 8-bit, groups of a
    multiple of 16, int8 values); it still declines inputs that are not [M, K] float32, and
    every input where the extension is not built."""
    return (
        isinstance(weight, GroupQuantized)
        and weight.bits == 8
        and weight.zero is None
        and weight.group_size % 16 == 0
        and weight.values.dtype == torch.int8
    )


def _pack_int4_rows(nibbles: torch.Tensor, rows_per_call: int = 4096) -> torch.Tensor:
    """PyTorch's CPU int4 packing of [N, K'] nibbles: in byte operations where the layout is
    known, else through PyTorch's converter a few thousand rows at a time (it takes int32: a
    whole LM head at once would need 4 bytes per value)."""
    block = _int4_pack_block()
    if block is not None:
        return _pack_cpu_int4(nibbles, block)
    num_rows = nibbles.shape[0]
    if num_rows <= rows_per_call:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
    parts = []
    for start in range(0, num_rows, rows_per_call):  # rows_per_call: a multiple of 64
        chunk = nibbles[start : start + rows_per_call].to(torch.int32)
        parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, 1))
    return torch.cat(parts)


def _default_layout(quantized: Quantized, device: torch.device) -> Layout:
    if device.type == "cuda":
        return "triton_fp8" if isinstance(quantized, Fp8Quantized) else "triton_int"
    if isinstance(quantized, GroupQuantized):
        num_cols = quantized.shape[1]
        per_channel_int8 = (
            quantized.group_size == num_cols
            and quantized.zero is None
            and quantized.value_range[0] >= -128
            and quantized.value_range[1] <= 127
        )
        if per_channel_int8 and _cpu_int8_available():
            return "cpu_int8"
        if _cpu_int4_available() and int4_operands(_shape_probe(quantized)) is not None:
            return "cpu_int4"
    return "reference"


def _shape_probe(quantized: GroupQuantized) -> GroupQuantized:
    """A one-group stand-in of `quantized` with its row count (cheap `int4_operands` check)."""
    num_rows = quantized.shape[0]
    group = quantized.group_size
    return GroupQuantized(
        torch.zeros(num_rows, group, dtype=torch.int8),
        torch.ones(num_rows, 1),
        None if quantized.zero is None else torch.zeros(num_rows, 1),
        group,
        quantized.value_range,
    )


# --------------------------------------------------------------------------- dispatch
def quant_linear_ref(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W^T (+ bias) with W the weight's exact dequantization (`weight.dequantize()`),
    computed in float32 and rounded to x's dtype once.

    Args:
        x: [M, K] activations.
        weight: [N, K].
        bias: [N] or None.

    Returns: [M, N] in x's dtype.
    """
    out = x.to(torch.float32) @ weight.dequantize().to(x.device).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W^T (+ bias) through the weight's kernel: on the CPU PyTorch's int4/int8 kernels in
    bfloat16 (x rounded to bfloat16, float32 accumulation, the result rounded to bfloat16, then
    cast to x's dtype) for every row count, except a symmetric 8-bit weight kept with its source
    (an LM head), which takes `cpu_extension.q8_linear` in float32 where it is built; on
    CUDA PyTorch's int4 kernel or the Triton kernels, for every row count: a row's value never
    depends on how many rows the product has. See `quant_linear_ref` for the value.

    Args:
        x: [..., K] activations.
        weight: [N, K].
        bias: [N] or None.

    Returns: [..., N] in x's dtype.
    """
    if x.dim() == 2:  # (the decode path's case: no reshapes)
        out = weight.matmul(x)
        return out if bias is None else out + bias
    lead = x.shape[:-1]
    out = weight.matmul(x.reshape(-1, x.shape[-1]))
    if bias is not None:
        out = out + bias
    return out.view(*lead, out.shape[-1])


def embedding_lookup(table: GroupQuantized, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows `token_ids` ([T] int64) of a quantized [V, D] table, dequantized exactly: [T, D]
    float32."""
    rows = table.values.index_select(0, token_ids).to(torch.float32)  # [T, D]
    num_tokens, dim = rows.shape
    groups = dim // table.group_size
    out = (
        rows.view(num_tokens, groups, table.group_size)
        * table.scale.index_select(0, token_ids)[:, :, None]
    )
    if table.zero is not None:
        out = out + table.zero.index_select(0, token_ids)[:, :, None]
    return out.view(num_tokens, dim)
