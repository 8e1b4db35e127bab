"""The CPU's C++ extension (`csrc/decode_layers.cpp`, `rng/csrc/philox_rows.cpp`): built once per
machine and PyTorch version on first use by `torch.utils.cpp_extension` (about a minute; cached
under `~/.cache/torch_extensions`), loaded by every later process. It holds the decode step's layer
loop (`decode_cpu_native`) and `q8_linear`, the product of a symmetric 8-bit group-quantized
weight (GGUF Q8_0, Q6_K: the built-in model's tied LM head) in float32 in one pass over its
bytes, where PyTorch's int4 kernel needs the weight split in two nibbles (twice the products);
its twin `q8_linear_ref` repeats its sums with PyTorch operations, bit for bit; and
`philox_rows`, the keyed random words of `specdec.rng` in exact integer arithmetic, with
`philox_uniform32_rows` (the same words as float32 uniforms) and `unusable_rows_f32` (the
sampler's check of logits rows, in one pass) (the engine hands them over:
`engine.setup.use_native_sampling`). Without a C++
compiler, or with `SPECDEC_CPU_NATIVE=0`, nothing is built and the callers run their Python
twins and PyTorch's kernels, after one log line saying why.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / "decode_layers.cpp",
    # specdec.rng's Philox rounds (all randomness lives under specdec/rng/), built in here
    Path(__file__).parents[1] / "rng" / "csrc" / "philox_rows.cpp",
    # the EAGLE head's CPU step (`drafters.eagle.head_native`: `torch.ops.specdec_eagle`)
    Path(__file__).parent / "csrc" / "head_step.cpp",
]
NAME = "specdec_decode_layers"
ENV_SWITCH = "SPECDEC_CPU_NATIVE"  # "0": never build or use the C++ loop


@functools.cache
def load_extension() -> Any | None:
    """The compiled extension, or None (with one log line) when it cannot be built here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU decode step: the Python loop (%s=0)", ENV_SWITCH)
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        if not (Path(_get_build_directory(NAME, verbose=False)) / f"{NAME}.so").exists():
            logger.warning("CPU decode step: building its C++ loop (once per machine, ~1 min)")
        start = time.perf_counter()
        module = load(
            name=NAME,
            sources=[str(source) for source in SOURCES],
            # -march=native: built on the machine it runs on; no FMA contraction, so that
            # q8_linear's sums are the ones its twin makes with PyTorch operations.
            # -fopenmp: q8_linear's at::parallel_for runs in PyTorch's OpenMP pool (the
            # process's one libgomp), not serially and not in threads of its own that would
            # compete with that pool's spinning workers.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a build error: run the twin
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.warning(
            "CPU decode step: running the Python loop (same results, slower): its C++ loop "
            "could not be built (%s)",
            first[:200],
        )
        return None
    elapsed = time.perf_counter() - start
    if elapsed > 2.0:  # a build, not a cache hit
        logger.info("CPU decode step: built its C++ loop in %.0f s (once per machine)", elapsed)
    return module


def q8_linear_ref(
    x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """The C++ `q8_linear`'s twin: x @ W^T for W = values * scale per group (symmetric 8-bit),
    with its sums in its order (see csrc/decode_layers.cpp), so that the two agree bit for bit.

    Args:
        x: [M, K] float32. values: [N, K] int8. scale: [N, K / group] float32.
        group: a multiple of 16 dividing K.

    Returns: [M, N] float32."""
    rows, cols = x.shape
    groups, chunks = cols // group, group // 16
    xs = x.view(rows, 1, groups, chunks, 16)
    qs = values.to(torch.float32).view(1, values.shape[0], groups, chunks, 16)
    lanes = torch.zeros(rows, values.shape[0], 16)
    for g in range(groups):
        sums = torch.zeros_like(lanes)
        for c in range(chunks):
            sums = sums + xs[:, :, g, c] * qs[:, :, g, c]
        lanes = lanes + sums * scale[None, :, g, None]
    v8 = lanes[..., :8] + lanes[..., 8:]
    v4 = v8[..., :4] + v8[..., 4:]
    return (v4[..., 0] + v4[..., 2]) + (v4[..., 1] + v4[..., 3])


def q8_linear(
    x: torch.Tensor, weight: Any, rows: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x @ W^T through the C++ `q8_linear` for a symmetric 8-bit group-quantized W (a
    `GroupQuantized`: GGUF Q8_0, Q6_K) and float32 x on the CPU; None where it does not apply
    or the extension is not built here (the caller's kernel then runs). One pass over W's
    bytes, float32 throughout: against PyTorch's int4 kernel over the weight split in two
    nibbles (twice the products, x and the result rounded to bfloat16), half the work.
    `rows` ([N'] int64): only those rows of W, read in place (output n is row rows[n]; the bits
    of the same product over a copy of them)."""
    if (
        x.dtype != torch.float32
        or x.dim() != 2
        or x.is_cuda
        or weight.bits != 8
        or weight.zero is not None
        or weight.group_size % 16
        or weight.values.dtype != torch.int8
    ):
        return None
    extension = load_extension()
    if extension is None:
        return None
    return extension.q8_linear(x, weight.values, weight.scale, weight.group_size, rows)
