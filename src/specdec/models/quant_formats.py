"""Quantized weight formats and the quantizers of float weights (all [N, K], rows = output
features): group-quantized integers (`GroupQuantized`: w = values * scale + zero per group of
K, the form GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q6_K decode to exactly, and what "int8" (per channel) and
"int4" (group-wise) quantize to) and FP8 e4m3 (`Fp8Quantized`: w = values * scale, one scale
per row or per tensor), with their exact dequantization. The kernels' layouts and the matmul
dispatch are `quant.py`'s. Nothing here reads files or draws randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# The `quantization=` engine argument: what a model's linear layers run as (None: float).
QUANTIZATIONS = ("gguf", "int8", "int4", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Group sizes tried, largest first, when quantizing to int4 (a K none divides: one group per row).
INT4_GROUP_SIZES = (128, 64, 32, 16)


def check_quantization(quantization: str | None) -> None:
    """Raises ValueError for a quantization we do not implement (named, with the choices)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r} is not supported; choose one of "
            f"{', '.join(QUANTIZATIONS)} or None (float weights)"
        )


# --------------------------------------------------------------------------- formats
@dataclass(frozen=True, slots=True)
class GroupQuantized:
    """w[n, k] = values[n, k] * scale[n, k // group_size] (+ zero[n, k // group_size]).

    Attributes:
        values: [N, K] int8 integer values, inside `value_range`.
        scale: [N, K / group_size] float32.
        zero: [N, K / group_size] float32 added after the product, or None (symmetric).
        group_size: values of one row sharing a scale (K for per-channel).
        value_range: (lowest, highest) value the format can hold, e.g. (0, 15) for Q4_1,
            (-8, 7) for Q4_0, (-128, 127) for Q8_0.
    """

    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    value_range: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    @property
    def bits(self) -> int:
        """4 when the values span at most 16 levels, else 8."""
        low, high = self.value_range
        return 4 if high - low < 16 else 8

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: values * scale (+ zero), one product and one sum per value, rounded
        as `gguf` rounds them (the exact dequantization)."""
        num_rows, num_cols = self.values.shape
        groups = num_cols // self.group_size
        values = self.values.to(torch.float32).view(num_rows, groups, self.group_size)
        out = values * self.scale[:, :, None]
        if self.zero is not None:
            out = out + self.zero[:, :, None]
        return out.view(num_rows, num_cols)

    def map_rows(self, fn) -> GroupQuantized:
        """The same weight with `fn` applied to the row axis of every tensor (e.g. a row
        permutation or selection; `fn` maps [N, ...] -> [N', ...])."""
        return replace(
            self,
            values=fn(self.values).contiguous(),
            scale=fn(self.scale).contiguous(),
            zero=None if self.zero is None else fn(self.zero).contiguous(),
        )

    def to(self, device: torch.device | str) -> GroupQuantized:
        return replace(
            self,
            values=self.values.to(device),
            scale=self.scale.to(device),
            zero=None if self.zero is None else self.zero.to(device),
        )

    @staticmethod
    def cat(parts: list[GroupQuantized]) -> GroupQuantized:
        """Row-wise concatenation (fused projections); the parts must share group size and
        value range."""
        first = parts[0]
        if any(
            p.group_size != first.group_size
            or p.value_range != first.value_range
            or (p.zero is None) != (first.zero is None)
            for p in parts
        ):
            raise ValueError("cannot concatenate group-quantized weights of different formats")
        return GroupQuantized(
            values=torch.cat([p.values for p in parts]),
            scale=torch.cat([p.scale for p in parts]),
            zero=None if first.zero is None else torch.cat([p.zero for p in parts]),  # type: ignore[misc]
            group_size=first.group_size,
            value_range=first.value_range,
        )


@dataclass(frozen=True, slots=True)
class Fp8Quantized:
    """w[n, k] = float(values[n, k]) * scale[n]: FP8 e4m3 with one scale per row (a per-tensor
    scale is stored repeated).

    Attributes:
        values: [N, K] torch.float8_e4m3fn.
        scale: [N] float32.
    """

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        return self.values.to(torch.float32) * self.scale[:, None]

    def map_rows(self, fn) -> Fp8Quantized:
        return Fp8Quantized(fn(self.values).contiguous(), fn(self.scale).contiguous())

    def to(self, device: torch.device | str) -> Fp8Quantized:
        return Fp8Quantized(self.values.to(device), self.scale.to(device))

    @staticmethod
    def cat(parts: list[Fp8Quantized]) -> Fp8Quantized:
        return Fp8Quantized(
            torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts])
        )


Quantized = GroupQuantized | Fp8Quantized


def concat_quantized(parts: list[Quantized]) -> Quantized:
    """Row-wise concatenation of weights of one format."""
    if all(isinstance(p, GroupQuantized) for p in parts):
        return GroupQuantized.cat(parts)  # type: ignore[arg-type]
    if all(isinstance(p, Fp8Quantized) for p in parts):
        return Fp8Quantized.cat(parts)  # type: ignore[arg-type]
    raise ValueError("cannot concatenate weights of different quantization formats")


# --------------------------------------------------------------------------- quantizers
def quantize_int8(weight: torch.Tensor, chunk_values: int = 1 << 20) -> GroupQuantized:
    """Symmetric per-channel int8 (gpt-fast's "int8"): scale = max|w| / 127 per row, in float32
    (a float16 or bfloat16 weight is upcast exactly). A few rows at a time, as each row's scale
    and values depend on that row alone: the float32 temporaries hold `chunk_values` values, not
    the whole weight (the same bits for any chunking).

    Args: weight: [N, K] float. Returns: GroupQuantized with group_size K, values in [-127, 127].
    """
    num_rows, num_cols = weight.shape
    values = torch.empty(num_rows, num_cols, dtype=torch.int8, device=weight.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=weight.device)
    rows_per_chunk = max(1, chunk_values // max(num_cols, 1))
    for start in range(0, num_rows, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        chunk = weight[rows].to(torch.float32)  # [n, K]
        low, high = torch.aminmax(chunk, dim=1, keepdim=True)  # max |w| = max(-low, high) exactly
        chunk_scale = torch.maximum(-low, high).clamp(min=1e-12) / 127.0  # [n, 1]
        scale[rows] = chunk_scale
        values[rows] = torch.div(chunk, chunk_scale).round_().clamp_(-127, 127)
    return GroupQuantized(values, scale, None, num_cols, (-127, 127))


def int4_group_size(num_cols: int) -> int:
    """The largest of INT4_GROUP_SIZES dividing K, else K (one group per row)."""
    for size in INT4_GROUP_SIZES:
        if num_cols % size == 0:
            return size
    return num_cols


def quantize_int4(weight: torch.Tensor, group_size: int | None = None) -> GroupQuantized:
    """Asymmetric group-wise int4 (min/max per group, as GGUF Q4_1 and gpt-fast's "int4"):
    w ~= q * scale + min with q in [0, 15].

    Args:
        weight: [N, K] float.
        group_size: values per group (default: `int4_group_size(K)`).
    """
    weight = weight.to(torch.float32)
    num_rows, num_cols = weight.shape
    group_size = group_size or int4_group_size(num_cols)
    groups = weight.view(num_rows, num_cols // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    values = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return GroupQuantized(
        values.to(torch.int8).view(num_rows, num_cols), scale, low, group_size, (0, 15)
    )


def quantize_fp8(weight: torch.Tensor, per_channel: bool = True) -> Fp8Quantized:
    """FP8 e4m3 with scale = max|w| / 448 per row (or one for the tensor).

    Args: weight: [N, K] float. Returns: Fp8Quantized.
    """
    weight = weight.to(torch.float32)
    if per_channel:
        absmax = weight.abs().amax(dim=1)
    else:
        absmax = weight.abs().amax().expand(weight.shape[0])
    scale = absmax.clamp(min=1e-12) / FP8_MAX  # [N]
    values = (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Quantized(values, scale.contiguous())


def quantize(
    weight: torch.Tensor, quantization: str, dtype: torch.dtype | None = None
) -> Quantized:
    """A float [N, K] weight in the format `quantization` ("int8", "int4", "fp8") names; with
    `dtype`, the weight as loaded in `dtype` (a weight kept in its file's dtype): `weight` cast
    to `dtype` first, a copy made only where `dtype` is not float32 (the quantizers compute in
    float32, and their own upcast is that cast)."""
    if dtype is not None and dtype != torch.float32:
        weight = weight.to(dtype)
    if quantization == "int8":
        return quantize_int8(weight)
    if quantization == "int4":
        return quantize_int4(weight)
    if quantization == "fp8":
        return quantize_fp8(weight)
    raise ValueError(f"cannot quantize a float weight to {quantization!r}")
