"""Philox4x32-10 and keyed float32 uniforms / Gumbel noise as Triton device functions: the GPU twin
of `specdec.rng.philox` and `specdec.rng.draws` (same counters, key, lane mapping and float32
conversion, so uniforms are bit-identical). Imported only when tensors are on CUDA (or under
TRITON_INTERPRET=1); holds no state and never draws outside a (seed, position, stream, step) key.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from specdec.rng.draws import Stream, _check_counter_word, _key_tensor

PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
TWO_POW_M32: tl.constexpr = tl.constexpr(2.0**-32)
UNIFORM32_MAX_F32: tl.constexpr = tl.constexpr(1.0 - 2.0**-24)

# Triton's interpreter (CPU debugging) has no libdevice; there the float32 functions below fall
# back to its numpy-backed `tl.log`, `tl.exp` and division.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """One Philox4x32-10 block per element of the (broadcast) uint32 inputs.

    Args:
        c0, c1, c2, c3: counter words, uint32 tensors or scalars.
        k0, k1: key words, uint32 scalars or tensors.

    Returns:
        The four uint32 output words (Salmon et al. 2011; Random123's philox4x32 with 10 rounds).
    """
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        n0 = hi1 ^ c1 ^ k0
        n2 = hi0 ^ c3 ^ k1
        c0 = n0
        c1 = lo1
        c2 = n2
        c3 = lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def words_to_uniform32(words):
    """uint32 words -> float32 u = fl32(fl32(x) + 0.5) * 2**-32, clamped to <= 1 - 2**-24."""
    u = (words.to(tl.float32) + 0.5) * TWO_POW_M32
    return tl.minimum(u, UNIFORM32_MAX_F32)


@triton.jit
def _log_libdevice(x):
    return libdevice.log(x)


@triton.jit
def _exp_libdevice(x):
    return libdevice.exp(x)


@triton.jit
def _log_interpret(x):
    return tl.log(x)


@triton.jit
def _exp_interpret(x):
    return tl.exp(x)


@triton.jit
def _fast_log_device(x):
    # MUFU lg2.approx: absolute error <= 2**-22.6 * ln 2 ~ 1.1e-7 for normal inputs.
    return libdevice.fast_logf(x)


@triton.jit
def _fast_div_device(x, y):
    # Reciprocal approximation times x: 2 ulps for normal y (no range fix-ups).
    return libdevice.fast_dividef(x, y)


@triton.jit
def _div_interpret(x, y):
    return x / y


# Accurate float32 log / exp (libdevice; Triton's tl.log / tl.exp are approximations).
log_f32 = _log_interpret if INTERPRET else _log_libdevice
exp_f32 = _exp_interpret if INTERPRET else _exp_libdevice
# Fast natural log with a small absolute error (the hardware approximation on the GPU).
fast_log = _log_interpret if INTERPRET else _fast_log_device
fast_div = _div_interpret if INTERPRET else _fast_div_device


@triton.jit
def neg_log1p_neg(u):
    """-log1p(-u) for float32 u in [0, 1), to a few ulps relative, without libdevice's log1p.

    u <= 1/2: 2 atanh(s) with s = u / (2 - u) <= 1/3, as the odd series 2 s (1 + s^2/3 + ...)
    (terms past s^15 are below 2**-26 relative); u > 1/2: -log(1 - u), where 1 - u is exact and
    |log(1 - u)| > 0.69, so the fast log's absolute error is a relative one of 1.6e-7.
    """
    s = fast_div(u, 2.0 - u)
    s2 = s * s
    p = s2 * 0.06666666666666667 + 0.07692307692307693
    p = p * s2 + 0.09090909090909091
    p = p * s2 + 0.1111111111111111
    p = p * s2 + 0.14285714285714285
    p = p * s2 + 0.2
    p = p * s2 + 0.3333333333333333
    p = p * s2 + 1.0
    return tl.where(u <= 0.5, 2.0 * s * p, -fast_log(1.0 - u))


@triton.jit
def uniform_to_gumbel(u):
    """Standard Gumbel noise -log(-log1p(-u)) in float32 (the twin of `draws.uniform_to_gumbel`).

    Within about 3e-7 (absolute) of the CPU's float32 value: -log1p(-u) to a few ulps relative
    (`neg_log1p_neg`), the outer log with the fast log's 1.1e-7 absolute error. Uniforms, not
    noise, are the bit-exact contract; the noise only has to rank tokens as the CPU's does.
    """
    return -fast_log(neg_log1p_neg(u))


@triton.jit
def key_words(seed):
    """int64 seed -> (k0, k1): its low and high 32-bit words as uint32 (any sign)."""
    return seed.to(tl.uint32), (seed >> 32).to(tl.uint32)


@triton.jit
def keyed_words_tile(seed, position, stream, step, first_block, ROWS: tl.constexpr):
    """Philox words for lanes 4 * first_block ... 4 * (first_block + ROWS) - 1 of one key.

    Args:
        seed: int64 scalar request seed.
        position, stream, step: integer scalars, counter words 1, 2, 3 (in [0, 2**32)).
        first_block: integer scalar, counter word 0 of row 0 of the tile.
        ROWS: tile rows (one Philox block each).

    Returns:
        [ROWS, 4] uint32: element [r, j] is float32 lane 4 * (first_block + r) + j, i.e. word j of
        block first_block + r (the lane mapping of `specdec.rng.draws`).
    """
    k0, k1 = key_words(seed)
    blocks = (first_block + tl.arange(0, ROWS)).to(tl.uint32)
    c1 = tl.cast(position, tl.uint32)
    c2 = tl.cast(stream, tl.uint32)
    c3 = tl.cast(step, tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(blocks, c1, c2, c3, k0, k1)
    j = tl.arange(0, 4)[None, :]
    return tl.where(
        j == 0,
        w0[:, None],
        tl.where(j == 1, w1[:, None], tl.where(j == 2, w2[:, None], w3[:, None])),
    )


@triton.jit
def gumbel_tile(seed, position, stream, step, first_block, ROWS: tl.constexpr):
    """[ROWS, 4] float32 Gumbel noise for the lanes of `keyed_words_tile` (same arguments)."""
    words = keyed_words_tile(seed, position, stream, step, first_block, ROWS)
    return uniform_to_gumbel(words_to_uniform32(words))


@triton.jit
def lane0_uniform(seed, positions, stream, step):
    """float32 uniform of lane 0 (word 0 of block 0) for a vector of positions under one key.

    Args:
        seed: int64 scalar. positions: [N] integer positions. stream, step: integer scalars.

    Returns:
        [N] float32, equal to `uniform(seed, positions, stream, 1, step=step)[:, 0]`.
    """
    k0, k1 = key_words(seed)
    zero = (positions * 0).to(tl.uint32)
    w0, _, _, _ = philox4x32_10(
        zero, positions.to(tl.uint32), tl.cast(stream, tl.uint32), tl.cast(step, tl.uint32), k0, k1
    )
    return words_to_uniform32(w0)


@triton.jit
def _uniform_kernel(
    seeds_ptr,  # [N] int64
    positions_ptr,  # [N] int64
    streams_ptr,  # [N] int64
    steps_ptr,  # [N] int64
    out_ptr,  # [N, num_lanes] float32
    num_lanes,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    stream = tl.load(streams_ptr + row)
    step = tl.load(steps_ptr + row)
    words = keyed_words_tile(seed, position, stream, step, tile * ROWS, ROWS)
    lanes = tile * (4 * ROWS) + tl.arange(0, ROWS)[:, None] * 4 + tl.arange(0, 4)[None, :]
    tl.store(out_ptr + row * num_lanes + lanes, words_to_uniform32(words), mask=lanes < num_lanes)


def uniform_triton(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    num_lanes: int,
    step: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Keyed float32 uniforms on the GPU, bit-identical to `specdec.rng.uniform` (float32 only).

    Args:
        seeds: [N] int64 request seeds (CUDA).
        positions: [N] int64 positions in [0, 2**32).
        stream: a `Stream`, an int, or [N] int64 stream ids.
        num_lanes: values per row (>= 1).
        step: int or [N] int64 in [0, 2**32), the extra counter word.

    Returns:
        [N, num_lanes] float32 in [2**-33, 1 - 2**-24].

    RNG: `stream` at (position, step), ceil(num_lanes / 4) Philox blocks per row.
    """
    if num_lanes < 1:
        raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
    if seeds.dim() != 1 or seeds.dtype != torch.int64:
        raise ValueError(
            f"seeds must be an int64 tensor [N], got {seeds.dtype} {list(seeds.shape)}"
        )
    num_rows, device = seeds.shape[0], seeds.device
    positions = _key_tensor("positions", positions, num_rows, device).contiguous()
    streams = _key_tensor("stream", stream, num_rows, device).contiguous()
    steps = _key_tensor("step", step, num_rows, device).contiguous()
    for name, words in (("positions", positions), ("step", steps), ("stream", streams)):
        _check_counter_word(name, words)
    out = torch.empty(num_rows, num_lanes, dtype=torch.float32, device=device)
    if num_rows == 0:
        return out
    rows = 256 if num_lanes > 512 else 32
    grid = (num_rows, triton.cdiv(num_lanes, 4 * rows))
    _uniform_kernel[grid](seeds.contiguous(), positions, streams, steps, out, num_lanes, ROWS=rows)
    return out


@triton.jit
def _philox_kernel(
    counters_ptr,  # [N, 4] int64 words in [0, 2**32)
    keys_ptr,  # [N, 2] int64 words in [0, 2**32)
    out_ptr,  # [N, 4] int64
    num_rows,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    c0 = tl.load(counters_ptr + rows * 4, mask=mask, other=0).to(tl.uint32)
    c1 = tl.load(counters_ptr + rows * 4 + 1, mask=mask, other=0).to(tl.uint32)
    c2 = tl.load(counters_ptr + rows * 4 + 2, mask=mask, other=0).to(tl.uint32)
    c3 = tl.load(counters_ptr + rows * 4 + 3, mask=mask, other=0).to(tl.uint32)
    k0 = tl.load(keys_ptr + rows * 2, mask=mask, other=0).to(tl.uint32)
    k1 = tl.load(keys_ptr + rows * 2 + 1, mask=mask, other=0).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + rows * 4, w0.to(tl.int64), mask=mask)
    tl.store(out_ptr + rows * 4 + 1, w1.to(tl.int64), mask=mask)
    tl.store(out_ptr + rows * 4 + 2, w2.to(tl.int64), mask=mask)
    tl.store(out_ptr + rows * 4 + 3, w3.to(tl.int64), mask=mask)


def philox_triton(counters: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`philox4x32_10` on the GPU for explicit words (for known-answer and parity tests).

    Args:
        counters: [N, 4] int64 counter words in [0, 2**32).
        keys: [N, 2] int64 key words in [0, 2**32).

    Returns:
        [N, 4] int64 output words in [0, 2**32).
    """
    num_rows = counters.shape[0]
    out = torch.empty(num_rows, 4, dtype=torch.int64, device=counters.device)
    if num_rows:
        block = 128
        _philox_kernel[(triton.cdiv(num_rows, block),)](
            counters.contiguous(), keys.contiguous(), out, num_rows, BLOCK=block
        )
    return out


__all__ = [
    "exp_f32",
    "fast_log",
    "gumbel_tile",
    "keyed_words_tile",
    "lane0_uniform",
    "log_f32",
    "neg_log1p_neg",
    "philox4x32_10",
    "philox_triton",
    "uniform_to_gumbel",
    "uniform_triton",
    "words_to_uniform32",
]
