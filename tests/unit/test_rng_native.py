"""The CPU extension's Philox rounds (`csrc/philox_rows.cpp`) against the torch and NumPy ones:
the same words, bit for bit, and `random_words` unchanged once the engine hands them over; its
float32 lanes (`philox_uniform32_rows`) equal to `uniform`'s mapping of those words, and its
one-pass check of logits rows (`unusable_rows_f32`) to `unusable_rows`' answer."""

from __future__ import annotations

import pytest
import torch

from specdec.models import cpu_extension
from specdec.rng import draws
from specdec.rng.draws import Stream
from specdec.rng.philox import (
    MASK32,
    native_rows,
    native_uniform32,
    philox4x32_10,
    philox4x32_10_torch,
    use_native_rows,
)
from specdec.sampling import processing

extension = cpu_extension.load_extension()
needs_extension = pytest.mark.skipif(
    extension is None, reason="the CPU extension is not built here (no compiler)"
)


@pytest.fixture
def handed_over():
    """The compiled rows handed to `random_words` for the test, the previous state after."""
    before = native_rows(), native_uniform32()
    use_native_rows(extension.philox_rows)
    yield
    use_native_rows(*before)


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


@needs_extension
@pytest.mark.parametrize("num_lanes", [1, 3, 4, 5, 4097, 49152, 151936])
def test_native_uniform32_lanes_equal_the_mapped_words(num_lanes: int) -> None:
    """Every lane of every row bit for bit (the edges of the key words among the rows), over
    vocabularies whose last block is partly used; the full-vocabulary rows span several of the
    kernel's tasks (2,048 blocks each), on however many threads PyTorch has."""
    c1, c2, c3, k0, k1 = _keys(5)
    native = extension.philox_uniform32_rows(c1, c2, c3, k0, k1, num_lanes)
    blocks = -(-num_lanes // 4)
    words = extension.philox_rows(c1, c2, c3, k0, k1, blocks).reshape(5, 4 * blocks)
    assert native.dtype == torch.float32
    assert torch.equal(native, draws.words_to_uniform32(words[:, :num_lanes]))


@needs_extension
def test_uniform_unchanged_with_the_native_lanes(handed_over) -> None:
    """`uniform` in float32 takes the native lanes once handed over: the same values as
    PyTorch's mapping of the same words; negative control: another step moves every row."""
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345], dtype=torch.int64)
    positions = torch.tensor([0, 5, 2**32 - 1, 77], dtype=torch.int64)
    mapped = draws.uniform(seeds, positions, Stream.DRAFT, 49152, step=3)
    use_native_rows(extension.philox_rows, extension.philox_uniform32_rows)
    fast = draws.uniform(seeds, positions, Stream.DRAFT, 49152, step=3)
    assert torch.equal(fast, mapped)
    other = draws.uniform(seeds, positions, Stream.DRAFT, 49152, step=4)
    assert (other != fast).any(dim=1).all()
    with pytest.raises(ValueError, match="positions"):  # the keys are checked as before
        draws.uniform(seeds, positions - 1, Stream.DRAFT, 8)


@needs_extension
def test_native_unusable_rows_answer_as_the_twin() -> None:
    """Rows with finite values, all -inf, all NaN, a +inf among finite values, NaN beside one
    finite value, half -inf, a -inf beside finite ones: the same answer as PyTorch's four
    passes (negative control: a +inf moved into a usable row flips it)."""
    logits = torch.randn(8, 1000)
    logits[1] = float("-inf")
    logits[2] = float("nan")
    logits[3, 5] = float("inf")
    logits[4] = float("nan")
    logits[4, 7] = 1.0
    logits[5, :500] = float("-inf")
    logits[6, 999] = float("-inf")
    logits[7, :] = float("inf")
    twin = ~torch.isfinite(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    native = extension.unusable_rows_f32(logits)
    assert native.tolist() == twin.tolist() == [False, True, True, True, False, False, False, True]
    logits[0, 3] = float("inf")
    assert bool(extension.unusable_rows_f32(logits)[0])
    before = processing._native_unusable
    processing.use_native_row_checks(extension.unusable_rows_f32)
    try:
        assert processing.unusable_rows(logits).tolist() == [True, *twin.tolist()[1:]]
        assert processing.unusable_rows(logits.to(torch.float64))[0]  # the twin's path
    finally:
        processing.use_native_row_checks(before)
    with pytest.raises(RuntimeError, match="unusable_rows_f32"):
        extension.unusable_rows_f32(logits.to(torch.bfloat16))
