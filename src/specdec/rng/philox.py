"""Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3") in torch.

The reference twin of `specdec.rng.philox_triton`: integer arithmetic only, so it is bit-exact on
any device. Words are held in int64 tensors with values in [0, 2**32); no intermediate ever
exceeds 2**49, so nothing relies on signed overflow. On the CPU the same rounds run in NumPy's
uint64 (a 32 x 32-bit product fits, and unsigned wrap-around is defined), with a third of the
operations, and in `random_words`' layout (counter word 0 along the row, every other word one
per row) with per-row scalar keys and the first rounds' row-constant words kept as scalars: one
full-vocabulary draw (12,288 blocks) takes 0.28 ms that way, 0.46 ms through the general NumPy
rounds and 1.58 ms through the torch operations on a 2-core machine, where sampling at T > 0
draws one every token (`benchmarks/probes/probe_cpu_philox.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # Philox's 4 output words

# `random_words`' rows in C++ (the CPU extension's `philox_rows`: (c1, c2, c3, k0, k1 [N],
# num_blocks) -> [N, num_blocks, 4]), once the extension is loaded; the same words. With them,
# optionally, `uniform`'s float32 lanes straight from the rounds (`philox_uniform32_rows`: the
# same keys, num_lanes -> [N, num_lanes] float32); the same values.
_native_rows: Callable[..., torch.Tensor] | None = None
_native_uniform32: Callable[..., torch.Tensor] | None = None


def use_native_rows(
    rows: Callable[..., torch.Tensor] | None,
    uniform32: Callable[..., torch.Tensor] | None = None,
) -> None:
    """Hands `random_words` a compiled twin of its CPU rounds, and `uniform` one of its float32
    lanes (None: back to NumPy's rounds and PyTorch's mapping)."""
    global _native_rows, _native_uniform32
    _native_rows = rows
    _native_uniform32 = uniform32


def native_rows() -> Callable[..., torch.Tensor] | None:
    """The compiled rows `use_native_rows` handed over, or None."""
    return _native_rows


def native_uniform32() -> Callable[..., torch.Tensor] | None:
    """The compiled float32 lanes `use_native_rows` handed over, or None."""
    return _native_uniform32


def _mulhilo(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of `a * multiplier` for 32-bit `a` and `multiplier`.

    The product is split as a * m_hi * 2**16 + a * m_lo with 16-bit halves of the multiplier, so
    every partial product stays below 2**48.
    """
    m_lo = multiplier & 0xFFFF
    m_hi = multiplier >> 16
    t_lo = a * m_lo
    t_hi = a * m_hi
    mid = t_lo + ((t_hi & 0xFFFF) << 16)
    return (t_hi >> 16) + (mid >> 32), mid & MASK32


def philox4x32_10(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: torch.Tensor,
    k1: torch.Tensor,
) -> Words:
    """One Philox4x32-10 block per element of the broadcast inputs.

    Args:
        c0, c1, c2, c3: counter words, int64 tensors with values in [0, 2**32).
        k0, k1: key words, int64 tensors with values in [0, 2**32).

    Returns:
        The four output words, int64 tensors with values in [0, 2**32), broadcast shape.
    """
    words = (c0, c1, c2, c3, k0, k1)
    if all(w.device.type == "cpu" and w.dtype == torch.int64 for w in words):
        return _philox_cpu(*words)
    return philox4x32_10_torch(*words)


def philox4x32_10_torch(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: torch.Tensor,
    k1: torch.Tensor,
) -> Words:
    """`philox4x32_10` in torch operations on any device (what CUDA graphs capture)."""
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


_CPU_CHUNK = 16384  # elements per pass: the working set of a pass stays in the cache
# The row-by-row rounds loop over rows in Python: for rows this narrow (small vocabularies, slot
# draws) the general rounds over every row at once are faster.
_ROWS_MIN_WIDTH = 1024


def _philox_cpu(*words: torch.Tensor) -> Words:
    """`philox4x32_10` for CPU int64 tensors, in NumPy uint64 (the same words, bit for bit:
    `tests/unit/test_rng.py` checks it against `philox4x32_10_torch`)."""
    c0, rest = words[0], words[1:]
    if (
        c0.dim() == 2
        and c0.shape[0] == 1
        and c0.shape[1] >= _ROWS_MIN_WIDTH
        and all(w.dim() == 2 and w.shape[1] == 1 for w in rest)
    ):
        return _philox_cpu_rows(c0[0], rest)  # `random_words`' layout, rows of many blocks
    return _philox_cpu_any(*words)


def _philox_cpu_any(*words: torch.Tensor) -> Words:
    """`_philox_cpu` for any broadcast layout: every word an array along the whole shape."""
    shape = torch.broadcast_shapes(*(w.shape for w in words))
    u64 = np.uint64
    ins = [np.broadcast_to(w.numpy().view(u64), shape).reshape(-1) for w in words]
    total = int(np.prod(shape, dtype=np.int64))
    outs = [np.empty(total, u64) for _ in range(4)]
    m0, m1, w0, w1 = u64(PHILOX_M0), u64(PHILOX_M1), u64(PHILOX_W0), u64(PHILOX_W1)
    mask, shift = u64(MASK32), u64(32)
    size = max(min(_CPU_CHUNK, total), 1)
    prod0, prod1, key0, key1 = (np.empty(size, u64) for _ in range(4))
    for start in range(0, total, _CPU_CHUNK):
        end = min(start + _CPU_CHUNK, total)
        n = end - start
        x0, x1, x2, x3 = (out[start:end] for out in outs)
        for out, source in zip((x0, x1, x2, x3), ins[:4], strict=True):
            out[...] = source[start:end]
        q0, q1, r0, r1 = prod0[:n], prod1[:n], key0[:n], key1[:n]
        r0[...], r1[...] = ins[4][start:end], ins[5][start:end]
        for round_index in range(PHILOX_ROUNDS):
            if round_index:
                np.bitwise_and(np.add(r0, w0, out=r0), mask, out=r0)
                np.bitwise_and(np.add(r1, w1, out=r1), mask, out=r1)
            np.multiply(x0, m0, out=q0)  # < 2**64: no wrap-around
            np.multiply(x2, m1, out=q1)
            # (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
            np.bitwise_xor(
                np.bitwise_xor(np.right_shift(q1, shift, out=x0), x1, out=x0), r0, out=x0
            )
            np.bitwise_xor(
                np.bitwise_xor(np.right_shift(q0, shift, out=x2), x3, out=x2), r1, out=x2
            )
            np.bitwise_and(q1, mask, out=x1)
            np.bitwise_and(q0, mask, out=x3)
    return tuple(torch.from_numpy(out.view(np.int64)).view(shape) for out in outs)


def _philox_cpu_rows(blocks: torch.Tensor, per_row: tuple[torch.Tensor, ...]) -> Words:
    """`_philox_cpu` for `random_words`' layout: counter word 0 = `blocks` [B] along the row,
    the other counter words and the key one value per row ([N, 1] each). Per row the keys are
    scalars, and so are two words of round 0 and one of round 1 (only c0 varies along the row),
    which saves about a third of the array operations of the general rounds."""
    rows, width = per_row[0].shape[0], blocks.shape[0]
    rows = max((w.shape[0] for w in per_row), default=rows)
    u64 = np.uint64
    c0 = blocks.numpy().view(u64)
    columns = [np.broadcast_to(w.numpy().view(u64).reshape(-1), (rows,)) for w in per_row]
    outs = [np.empty((rows, width), u64) for _ in range(4)]
    m0, m1, mask, shift = u64(PHILOX_M0), u64(PHILOX_M1), u64(MASK32), u64(32)
    size = max(min(_CPU_CHUNK, width), 1)
    q0_buf, q1_buf = np.empty(size, u64), np.empty(size, u64)
    for r in range(rows):
        c1, c2, c3, key0, key1 = (int(column[r]) for column in columns)
        keys = [
            ((key0 + i * PHILOX_W0) & MASK32, (key1 + i * PHILOX_W1) & MASK32)
            for i in range(PHILOX_ROUNDS)
        ]  # each round's key words
        for start in range(0, width, _CPU_CHUNK):
            end = min(start + _CPU_CHUNK, width)
            n = end - start
            x0, x1, x2, x3 = (out[r, start:end] for out in outs)
            q0, q1 = q0_buf[:n], q1_buf[:n]
            # Round 0: c1, c2, c3 are scalars; so are the new x0, x1.
            k0, k1 = keys[0]
            np.multiply(c0[start:end], m0, out=q0)
            p1 = c2 * PHILOX_M1
            s0, s1 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32
            np.bitwise_xor(np.right_shift(q0, shift, out=x2), u64(c3 ^ k1), out=x2)
            np.bitwise_and(q0, mask, out=x3)
            # Round 1: x0, x1 scalars; the new x3 is a scalar.
            k0, k1 = keys[1]
            p0 = s0 * PHILOX_M0
            np.multiply(x2, m1, out=q1)
            np.bitwise_xor(np.right_shift(q1, shift, out=x0), u64(s1 ^ k0), out=x0)
            np.bitwise_and(q1, mask, out=x1)
            np.bitwise_xor(x3, u64((p0 >> 32) ^ k1), out=x2)
            s3 = p0 & MASK32
            # Round 2: x3 a scalar.
            k0, k1 = keys[2]
            np.multiply(x0, m0, out=q0)
            np.multiply(x2, m1, out=q1)
            np.bitwise_xor(np.right_shift(q1, shift, out=x0), x1, out=x0)
            np.bitwise_xor(x0, u64(k0), out=x0)
            np.bitwise_xor(np.right_shift(q0, shift, out=x2), u64(s3 ^ k1), out=x2)
            np.bitwise_and(q1, mask, out=x1)
            np.bitwise_and(q0, mask, out=x3)
            for k0, k1 in keys[3:]:
                np.multiply(x0, m0, out=q0)
                np.multiply(x2, m1, out=q1)
                np.bitwise_xor(np.right_shift(q1, shift, out=x0), x1, out=x0)
                np.bitwise_xor(x0, u64(k0), out=x0)
                np.bitwise_xor(np.right_shift(q0, shift, out=x2), x3, out=x2)
                np.bitwise_xor(x2, u64(k1), out=x2)
                np.bitwise_and(q1, mask, out=x1)
                np.bitwise_and(q0, mask, out=x3)
    return tuple(torch.from_numpy(out.view(np.int64)) for out in outs)
