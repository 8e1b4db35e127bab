"""Request seeds: a fresh 64-bit seed for a request that brings none (recorded so the request can be
replayed), and the seeds of a request's n samples derived from its own."""

from __future__ import annotations

import secrets

import torch

from specdec.rng.philox import MASK32, philox4x32_10


def fresh_seed() -> int:
    """A new signed 64-bit seed from the operating system's entropy."""
    return to_signed64(secrets.randbits(64))


def to_signed64(value: int) -> int:
    """Maps any integer to the signed 64-bit value with the same low 64 bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed` (index 0 keeps `seed`).

    Other samples take two output words of one Philox call keyed by `seed` with counter
    (index, 0, 0xFFFFFFFF, 0): a stream id no draw uses, so sample seeds never alias draws.
    """
    if index == 0:
        return seed
    seed = to_signed64(seed)
    key = torch.tensor([seed], dtype=torch.int64)
    words = philox4x32_10(
        torch.tensor([index]),
        torch.tensor([0]),
        torch.tensor([MASK32]),
        torch.tensor([0]),
        key & MASK32,
        (key >> 32) & MASK32,
    )
    return to_signed64(int(words[0]) | (int(words[1]) << 32))
