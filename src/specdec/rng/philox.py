"""Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3") in torch.

The reference twin of `specdec.rng.philox_triton`: integer arithmetic only, so it is bit-exact on
any device. Words are held in int64 tensors with values in [0, 2**32); no intermediate ever
exceeds 2**49, so nothing relies on signed overflow.
"""

from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Philox4x32-10 block per element of the broadcast inputs.

    Args:
        c0, c1, c2, c3: counter words, int64 tensors with values in [0, 2**32).
        k0, k1: key words, int64 tensors with values in [0, 2**32).

    Returns:
        The four output words, int64 tensors with values in [0, 2**32), broadcast shape.
    """
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3
