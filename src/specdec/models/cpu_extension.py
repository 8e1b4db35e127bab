"""The CPU's C++ extension (`csrc/decode_layers.cpp`, `rng/csrc/philox_rows.cpp`): built once per
machine and PyTorch version on first use by `torch.utils.cpp_extension` (about a minute; cached
under `~/.cache/torch_extensions`), loaded by every later process. It holds the decode step's layer
loop (`decode_cpu_native`) and `q8_linear`, the product of a symmetric 8-bit group-quantized
weight (GGUF Q8_0, Q6_K: the built-in model's tied LM head) in float32 in one pass over its
bytes, where PyTorch's int4 kernel needs the weight split in two nibbles (twice the products);
its twin `q8_linear_ref` repeats its sums with PyTorch operations, bit for bit;
`row_attention`, the CPU step's attention (prefill rows included: each row over its own keys, in
arithmetic of its own, all rows of a step in one call over the intra-op threads), with its twin
`row_attention_ref`, bit for bit; and
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


def _lanes_finish_ref(lanes: torch.Tensor) -> torch.Tensor:
    """The C++ `lanes_finish`: [..., 16] float32 lanes summed pairwise -> [...]."""
    v8 = lanes[..., :8] + lanes[..., 8:]
    v4 = v8[..., :4] + v8[..., 4:]
    return (v4[..., 0] + v4[..., 2]) + (v4[..., 1] + v4[..., 3])


def exp_nonpositive_ref(x: torch.Tensor) -> torch.Tensor:
    """The C++ `exp_nonpositive`'s twin, bit for bit: exp of float32 x <= 0 (below -87 taken as
    -87) in Cephes' float32 steps (n = round(x log2 e), r = x - n ln 2 in two parts, a degree-7
    polynomial, times 2^n)."""
    x = x.clamp_min(-87.0)
    n = (x * 1.44269504088896341 + 12582912.0) - 12582912.0
    r = x - n * 0.693359375
    r = r - n * -2.12194440e-4
    p = torch.full_like(x, 1.9875691500e-4)
    for coefficient in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1):
        p = p * r + coefficient
    p = p * r + 5.0000001201e-1
    p = (p * (r * r) + r) + 1.0
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * two_n


def row_attention_ref(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """The C++ `row_attention`'s twin for one query row, bit for bit (its arithmetic is in
    csrc/decode_layers.cpp, `attend_row`): float32 attention over exactly the given keys, with
    16-lane dot products finished pairwise, `exp_nonpositive` and sums in key order.

    Args:
        query: [H_q, D] float32 (D a multiple of 16).
        keys, values: [S, H_kv, D] float32, the keys the row sees.
        scale: softmax scale.

    Returns: [H_q, D] float32."""
    num_heads, head_dim = query.shape
    count, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)  # [S, H_q, D]
    values = values.repeat_interleave(group, dim=1)
    products = (query[None] * keys).view(count, num_heads, head_dim // 16, 16)
    lanes = torch.zeros(count, num_heads, 16)
    for c in range(head_dim // 16):
        lanes = lanes + products[:, :, c]
    scores = (_lanes_finish_ref(lanes) * scale).t()  # [H_q, S]
    weights = exp_nonpositive_ref(scores - scores.amax(-1, keepdim=True))
    padded = torch.cat([weights, weights.new_zeros(num_heads, -count % 16)], dim=-1)
    sums = torch.zeros(num_heads, 16)
    for chunk in padded.view(num_heads, -1, 16).unbind(1):
        sums = sums + chunk
    total = _lanes_finish_ref(sums)  # [H_q]
    out = torch.zeros(num_heads, head_dim)
    for s in range(count):
        out = out + weights[:, s, None] * values[s]
    return out / total[:, None]


def row_attention(
    query: torch.Tensor,
    sequences: list[tuple[int, torch.Tensor, torch.Tensor, list[int], list[int]]],
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Attention of query rows over their keys through the C++ `row_attention`, each row's
    arithmetic its own (`row_attention_ref`), into `out`; False (nothing written) where it does
    not apply (query not float32, D not a multiple of 16) or the extension is not built here.

    Args:
        query: [T, H_q, D] float32 (the head dimension contiguous).
        sequences: per sequence (its first query row, keys and values [S, H_kv, D], and per
            row j of it the key range [begins[j], ends[j]) it sees).
        scale: softmax scale.
        out: [T, H_q, D] float32 contiguous.

    Mutates: `out`'s rows of the sequences (other rows untouched)."""
    if query.dtype != torch.float32 or query.shape[-1] % 16 or query.stride(-1) != 1:
        return False
    extension = load_extension()
    if extension is None:
        return False
    offsets, begins, ends = [0], [], []
    for _, _, _, row_begins, row_ends in sequences:
        begins += row_begins
        ends += row_ends
        offsets.append(len(begins))
    extension.row_attention(
        query,
        [keys.to(torch.float32).contiguous() for _, keys, _, _, _ in sequences],
        [values.to(torch.float32).contiguous() for _, _, values, _, _ in sequences],
        [first_row for first_row, *_ in sequences],
        offsets,
        begins,
        ends,
        scale,
        out,
    )
    return True
