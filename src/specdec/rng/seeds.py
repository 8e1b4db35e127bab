"""Request seeds: a fresh 64-bit seed for a request that brings none (recorded so the request can be
replayed), and the seeds of a request's n samples derived from its own; fresh request ids (the
server's, which must not be guessable or repeat across restarts)."""

from __future__ import annotations

import secrets

import torch

from specdec.rng.philox import MASK32, philox4x32_10


def fresh_seed() -> int:
    """A new signed 64-bit seed from the operating system's entropy."""
    return to_signed64(secrets.randbits(64))


def engine_request_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th request without a seed of an engine seeded with `seed` (so a
    script run twice replays): two output words of one Philox call keyed by `seed` with counter
    (index, 1, 0xFFFFFFFF, 0), words `derive_seed` never uses."""
    return _philox_seed(seed, index, 1)


def fresh_request_id() -> str:
    """32 hex digits (128 bits) from the operating system's entropy (a uuid4's worth)."""
    return f"{secrets.randbits(128):032x}"


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
    return _philox_seed(seed, index, 0)


def _philox_seed(seed: int, index: int, word: int) -> int:
    cpu = torch.device("cpu")  # a host computation, whatever the default device
    key = torch.tensor([to_signed64(seed)], dtype=torch.int64, device=cpu)
    words = philox4x32_10(
        torch.tensor([index], device=cpu),
        torch.tensor([word], device=cpu),
        torch.tensor([MASK32], device=cpu),
        torch.tensor([0], device=cpu),
        key & MASK32,
        (key >> 32) & MASK32,
    )
    return to_signed64(int(words[0]) | (int(words[1]) << 32))
