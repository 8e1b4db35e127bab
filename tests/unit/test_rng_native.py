"""The CPU extension's Philox rounds (`csrc/philox_rows.cpp`) against the torch and NumPy ones:
the same words, bit for bit, and `random_words` unchanged once the engine hands them over."""

from __future__ import annotations

import pytest
import torch

from specdec.models import cpu_extension
from specdec.rng import draws
from specdec.rng.draws import Stream
from specdec.rng.philox import (
    MASK32,
    native_rows,
    philox4x32_10,
    philox4x32_10_torch,
    use_native_rows,
)

extension = cpu_extension.load_extension()
needs_extension = pytest.mark.skipif(
    extension is None, reason="the CPU extension is not built here (no compiler)"
)


@pytest.fixture
def handed_over():
    """The compiled rows handed to `random_words` for the test, the previous state after."""
    before = native_rows()
    use_native_rows(extension.philox_rows)
    yield
    use_native_rows(before)


def _keys(rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    words = [torch.randint(0, 2**32, (rows,), generator=gen, dtype=torch.int64) for _ in range(5)]
    for word in words:  # the edges of a word's range
        word[0], word[1] = 0, MASK32
    return words


@needs_extension
@pytest.mark.parametrize("num_blocks", [1, 3, 1000, 12288])
def test_native_rows_equal_the_torch_and_numpy_rounds(num_blocks: int) -> None:
    c1, c2, c3, k0, k1 = _keys(5)
    native = extension.philox_rows(c1, c2, c3, k0, k1, num_blocks)
    blocks = torch.arange(num_blocks, dtype=torch.int64)[None, :]
    args = (blocks, c1[:, None], c2[:, None], c3[:, None], k0[:, None], k1[:, None])
    for rounds in (philox4x32_10_torch, philox4x32_10):  # philox4x32_10: NumPy's on the CPU
        assert torch.equal(native, torch.stack(rounds(*args), dim=-1))


@needs_extension
def test_negative_control_a_key_word_apart_gives_other_words() -> None:
    c1, c2, c3, k0, k1 = _keys(3)
    native = extension.philox_rows(c1, c2, c3, k0, k1, 64)
    other = extension.philox_rows(c1, c2, c3, k0, k1 ^ 1, 64)
    assert not torch.equal(native, other)
    assert (native != other).all(dim=-1).all()  # every block of every row moves


@needs_extension
def test_random_words_unchanged_with_the_native_rows(handed_over) -> None:
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345], dtype=torch.int64)
    positions = torch.tensor([0, 5, 2**32 - 1, 77], dtype=torch.int64)
    fast = draws.random_words(seeds, positions, Stream.TARGET, 4097, step=3)
    uniforms = draws.uniform(seeds, positions, Stream.DRAFT, 49152)
    use_native_rows(None)
    assert torch.equal(fast, draws.random_words(seeds, positions, Stream.TARGET, 4097, step=3))
    assert torch.equal(uniforms, draws.uniform(seeds, positions, Stream.DRAFT, 49152))


@needs_extension
def test_native_rows_refuse_bad_words() -> None:
    words = _keys(2)
    with pytest.raises(RuntimeError, match="philox_rows"):
        extension.philox_rows(*words[:4], words[4][:1], 8)  # rows of unequal length
    with pytest.raises(RuntimeError, match="philox_rows"):
        extension.philox_rows(*(w.to(torch.int32) for w in words), 8)
