"""Float products whose rows never depend on the batch: `batch_invariant_linear` (dispatch),
its twin `batch_invariant_linear_ref`, and `check_cublas_rows`, the start-up check that decides
which weights may keep cuBLAS.

A decode row's logits must not change with what shares its step (other requests' decode,
verify or prefill rows, the CUDA-graph bucket). cuBLAS picks its kernel, split-K included, by
the row count, and on the H200 that changes a row's bits for some weights (Llama-3-8B's from 64
rows on) and not for others (SmolLM2's, up to 512 rows at least). So on CUDA a weight keeps
cuBLAS only where `check_cublas_rows` found every row of every row count the engine can run
equal to the row alone; every other float product runs `linear_triton`, whose rows are the
same bits for every row count. On the CPU the product runs in chunks of exactly
`CPU_ROW_CHUNK` rows (one F.linear each), so the BLAS sees one row count
whatever the step holds; `cpu_rows_invariant` checks that, per weight shape, before use (the
kept-quantized default takes the weight-only kernels of `quant.py` instead). Nothing here draws
randomness.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

# Whether CUDA products are made row-invariant at all (probes measure the cost by turning it
# off; the engine never does).
ROW_INVARIANT_ON_CUDA = True
# On the CPU, which rows share a BLAS kernel depends on the machine: on a 2-core AMD EPYC every
# multiple of 4 rows gave a row the same bits; on a 2-core Intel Xeon (MKL, AVX-512) the same
# holds for 576 x 576 but not for 1536 x 576 (one kernel for 2-15 rows, another from 16 on) or
# 576 x 1536 (a third for 57-128 rows). One row count for every product avoids the question: rows
# go in chunks of this many (the last padded with zeros), one F.linear per chunk, and a row's bits
# were the same at every position of a chunk on both machines (checked per shape at first use:
# `cpu_rows_invariant`; tests/unit/models/test_linear_cpu.py guards it). A batched product over
# the chunks (torch.bmm) is not: its kernel changes with the number of chunks for some shapes.
CPU_ROW_CHUNK = 16

# (N, K, dtype, device) of a weight -> the most rows for which cuBLAS was checked to give every
# row the bits of the row alone (absent: not checked or failed: the Triton kernel).
_CUBLAS_ROWS: dict[tuple[int, int, torch.dtype, torch.device], int] = {}


def batch_invariant_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ bias) computed in float32 and rounded to x's dtype once (the twin the kernel is
    compared with: equal up to the kernel's float32 accumulation order).

    Args: x: [M, K]. weight: [N, K]. bias: [N] or None. Returns: [M, N] in x's dtype."""
    out = x.to(torch.float32) @ weight.to(torch.float32).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _chunked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ bias) over x's rows in chunks of CPU_ROW_CHUNK rows (the last padded with zeros),
    one F.linear per chunk: the CPU's row-invariant product where `cpu_rows_invariant` passed
    for the weight's shape, else one row at a time. x: [..., K] -> [..., N]."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    size = CPU_ROW_CHUNK if cpu_rows_invariant(weight) else 1
    extra = -count % size
    if extra:
        rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
    if rows.shape[0] == size:
        out = F.linear(rows, weight, bias)
    else:
        out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(size)])
    out = out[:count]
    return out.reshape(*lead, out.shape[-1])


# (N, K, dtype) of a CPU weight -> whether its chunked product passed `cpu_rows_invariant`.
_CPU_CHUNK_OK: dict[tuple[int, int, torch.dtype], bool] = {}


@torch.inference_mode()
def cpu_rows_invariant(weight: torch.Tensor) -> bool:
    """Whether a `CPU_ROW_CHUNK`-row product gives a row the same bits at any position of the
    chunk, whatever shares it, for this weight's shape (checked once per shape and dtype, on
    fixed inputs: the BLAS picks its kernel by shapes, not values). A shape that fails runs one
    row at a time (slow, and logged once)."""
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    known = _CPU_CHUNK_OK.get(key)
    if known is not None:
        return known
    depth, size = weight.shape[1], 3 * CPU_ROW_CHUNK
    grid = torch.arange(size * depth, dtype=torch.float32)
    x = torch.sin(grid * 0.618034).mul_(2.0).view(size, depth).to(weight.dtype)
    full = torch.cat([F.linear(chunk, weight) for chunk in x.split(CPU_ROW_CHUNK)])
    alone = x.new_zeros(CPU_ROW_CHUNK, depth)
    passed = True
    for i in (0, 1, CPU_ROW_CHUNK - 1, CPU_ROW_CHUNK + 5, size - 1):
        alone[0] = x[i]
        if not torch.equal(F.linear(alone, weight)[0], full[i]):
            passed = False
            break
    _CPU_CHUNK_OK[key] = passed
    if not passed:
        logging.getLogger(__name__).warning(
            "this machine's BLAS gives rows of a %d x %d %s product other bits by their position "
            "in a %d-row chunk: those products run one row at a time (slower) to stay "
            "batch-invariant",
            *weight.shape,
            weight.dtype,
            CPU_ROW_CHUNK,
        )
    return passed


def _key(weight: torch.Tensor) -> tuple[int, int, torch.dtype, torch.device]:
    return (weight.shape[0], weight.shape[1], weight.dtype, weight.device)


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for x of [..., K] and weight [N, K]: on CUDA every row computed as it
    would be alone (cuBLAS for a weight `check_cublas_rows` cleared, in slices of at most the
    rows it checked; `linear_triton` otherwise); on the CPU in chunks of `CPU_ROW_CHUNK` rows
    (`_chunked_linear`). Returns [..., N] in x's dtype, or in `out_dtype` (only float32: the
    product of the widened x and weight, which on CUDA the Triton kernel computes on x and
    weight of one 16-bit dtype with its float32 sums stored unrounded; the mixture-of-experts
    router)."""
    if out_dtype is not None and out_dtype != x.dtype:
        if out_dtype != torch.float32:
            raise ValueError(f"out_dtype {out_dtype} over {x.dtype} (only float32 is taken)")
        if not (x.is_cuda and ROW_INVARIANT_ON_CUDA and x.dtype == weight.dtype):
            widened = None if bias is None else bias.float()
            return batch_invariant_linear(x.float(), weight.float(), widened)
        from specdec.models.linear_triton import linear_triton

        rows = x.reshape(-1, x.shape[-1])
        out = linear_triton(rows, weight, bias, out_dtype=out_dtype)
        return out.view(*x.shape[:-1], out.shape[-1])
    if not x.is_cuda:
        return _chunked_linear(x, weight, bias)
    if not ROW_INVARIANT_ON_CUDA or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    checked = _CUBLAS_ROWS.get(_key(weight))
    if checked is not None:
        if rows.shape[0] <= checked:
            out = F.linear(rows, weight, bias)
        else:
            out = torch.cat([F.linear(part, weight, bias) for part in rows.split(checked)])
    else:
        from specdec.models.linear_triton import linear_triton

        out = linear_triton(rows, weight, bias)
    return out.view(*lead, out.shape[-1])


def order_sensitive_rows(
    rows: int, depth: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Inputs whose products against a weight of ones change bits with the order of the sum.

    Each row holds small values of the dtype's full mantissa and `_ORDER_PAIRS` pairs of a large
    +B and -B at row-dependent positions: the exact dot product is the small values' sum, but
    every small value added while a partial sum holds an uncancelled B loses low bits, so two
    kernels that split or order the depth differently give rows other bits. B is chosen from
    the dtype so that the loss shows in the rounded output (bfloat16 keeps 8 bits of it), and
    small enough that no partial sum of float16 rows overflows a float16 accumulator. A
    weight's own values can hide a kernel change (s33: the tiny model's 97 x 64 head passed
    the check on `sin` inputs while its rows took other bits at 5 rows than alone).

    Returns: [rows, depth] of `dtype` (no randomness: `sin` of a grid)."""
    small = 2.0**-8 if dtype == torch.float16 else 1.0
    big = small * torch.finfo(dtype).eps * 2.0**27 * max(1.0, (depth / 64) ** 0.5)
    grid = torch.arange(rows * depth, device=device, dtype=torch.float32).view(rows, depth)
    x = torch.sin(grid * 0.618034).mul_(2.0 * small)
    pairs = min(_ORDER_PAIRS, depth // 4)
    if pairs:
        positions = torch.argsort(torch.sin(grid * 0.7548777 + grid[:, :1] * 0.3), dim=1)
        signs = torch.tensor([big, -big], device=device).repeat(pairs)
        x.scatter_(1, positions[:, : 2 * pairs], signs.expand(rows, -1).contiguous())
    return x.to(dtype)


# Pairs of cancelling large values an order-sensitive row holds (few, so that no partial sum of
# float16 rows overflows a float16 accumulator; their positions vary by row).
_ORDER_PAIRS = 4


@torch.inference_mode()
def check_cublas_rows(weights: Iterable[torch.Tensor], max_rows: int) -> dict[tuple, bool]:
    """Decides, for each distinct CUDA weight shape, whether cuBLAS may compute its products:
    for every row count 1..max_rows, F.linear over x[:M] must give every row the bits it gets
    alone, on two problems of the weight's shape (cuBLAS chooses its kernel by shapes, not
    values): the weight itself on fixed inputs, and a weight of ones on `order_sensitive_rows`,
    whose rows change bits with any change of the summation order (a weight's own values can
    hide one). Records the weights that pass for `batch_invariant_linear`; a shape that fails
    (or was never checked) takes the Triton kernel. Stops at a shape's first differing row
    count.

    Args:
        weights: the model's float weights ([N, K] each; other devices are skipped).
        max_rows: the most rows a product of the engine can have (its steps' token budget).

    Returns: {(N, K, dtype, device): passed} for the shapes checked now.
    """
    results: dict[tuple, bool] = {}
    for weight in weights:
        key = _key(weight)
        if not weight.is_cuda or key in results or key in _CUBLAS_ROWS:
            continue
        depth = weight.shape[1]
        # Deterministic inputs of varied magnitude (no randomness: none outside rng/).
        grid = torch.arange(max_rows * depth, device=weight.device, dtype=torch.float32)
        x = torch.sin(grid * 0.618034).mul_(2.0).view(max_rows, depth).to(weight.dtype)
        ones = torch.ones_like(weight)
        x_order = order_sensitive_rows(max_rows, depth, weight.dtype, weight.device)
        problems = [(x, weight), (x_order, ones)]
        alone = [
            torch.cat([F.linear(rows[i : i + 1], w) for i in range(max_rows)])
            for rows, w in problems
        ]
        differs = torch.zeros((), dtype=torch.bool, device=weight.device)
        passed = True
        for count in range(2, max_rows + 1):
            for (rows, w), want in zip(problems, alone, strict=True):
                differs |= (F.linear(rows[:count], w) != want[:count]).any()
            if (count % 64 == 0 or count == max_rows) and bool(differs):
                passed = False
                break
        results[key] = passed
        if passed:
            _CUBLAS_ROWS[key] = max_rows
    return results
