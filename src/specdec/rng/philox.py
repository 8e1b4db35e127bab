"""Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3") in torch.

The reference twin of `specdec.rng.philox_triton`: integer arithmetic only, so it is bit-exact on
any device. Words are held in int64 tensors with values in [0, 2**32); no intermediate ever
exceeds 2**49, so nothing relies on signed overflow. On the CPU the same rounds run in NumPy's
uint64 (a 32 x 32-bit product fits, and unsigned wrap-around is defined), with a third of the
operations: one full-vocabulary draw (12,288 blocks) takes 0.51 ms this way against 1.66 ms
through the torch operations on a 2-core machine, where sampling at T > 0 draws one every token
(`benchmarks/probes/probe_cpu_philox.py`).
"""

from __future__ import annotations

import numpy as np
import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # Philox's 4 output words


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


def _philox_cpu(*words: torch.Tensor) -> Words:
    """`philox4x32_10` for CPU int64 tensors, in NumPy uint64 (the same words, bit for bit:
    `tests/unit/test_rng.py` checks it against `philox4x32_10_torch`)."""
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
