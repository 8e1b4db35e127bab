"""Unit tests of specdec.rng: Philox4x32-10 known answers, the keyed draws and their contract."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.rng import (
    UNIFORM32_MAX,
    Stream,
    gumbel,
    philox4x32_10,
    random_words,
    uniform,
    uniform_to_gumbel,
    words_to_uniform32,
    words_to_uniform64,
)
from specdec.rng.philox import philox4x32_10_torch

# Random123's kat_vectors for philox4x32_10: (counter, key, output), words in hex.
KAT_VECTORS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox_python(counter: tuple[int, ...], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 on Python integers, written from Salmon et al. (SC'11), for cross-checks."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def words(values) -> list[torch.Tensor]:
    return [torch.tensor([v], dtype=torch.int64) for v in values]


@pytest.mark.parametrize("counter, key, expected", KAT_VECTORS)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32_10(*words(counter), *words(key))
    assert [int(w) for w in out] == list(expected)


@pytest.mark.parametrize("counter, key, expected", KAT_VECTORS)
def test_python_twin_known_answers(counter, key, expected):
    assert philox_python(counter, key) == expected


def test_philox_matches_python_twin_on_random_inputs():
    """The 16-bit split multiply must be exact for every 32-bit input, not just the KATs."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 2**32, (500, 6), generator=generator, dtype=torch.int64)
    inputs[:50] = torch.tensor([0, 2**32 - 1, 1, 2**31, 2**16, 2**16 - 1])[
        torch.randint(0, 6, (50, 6), generator=generator)
    ]
    out = torch.stack(philox4x32_10(*inputs.unbind(1)), dim=1)
    for row, result in zip(inputs.tolist(), out.tolist(), strict=True):
        assert tuple(result) == philox_python(tuple(row[:4]), tuple(row[4:]))


@pytest.mark.parametrize("counter, key, expected", KAT_VECTORS)
def test_torch_operations_known_answers(counter, key, expected):
    """The torch-operation rounds (CUDA's eager path and graphs), beside the CPU's NumPy ones."""
    out = philox4x32_10_torch(*words(counter), *words(key))
    assert [int(w) for w in out] == list(expected)


@pytest.mark.parametrize("shape", [(1, 12288), (3, 5), (2, 40000), (0, 4), (0, 2048), (3, 1024)])
def test_cpu_rounds_equal_the_torch_operations_bit_for_bit(shape):
    """The CPU's NumPy rounds against the torch ones on broadcast inputs like `random_words`'
    (blocks along the last axis, per-row words), edge words included, across several chunks;
    a changed round constant would make them differ (checked: the control below)."""
    generator = torch.Generator().manual_seed(1)
    rows, blocks = shape
    c0 = torch.arange(blocks, dtype=torch.int64)[None, :]
    per_row = torch.randint(0, 2**32, (5, rows, 1), generator=generator, dtype=torch.int64)
    if rows:
        per_row[:, 0] = 2**32 - 1
    want = philox4x32_10_torch(c0, *per_row)
    got = philox4x32_10(c0, *per_row)
    assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if rows and blocks:  # the control: one key word off by one gives other words
        other = philox4x32_10(c0, *per_row[:4], per_row[4] ^ 1)
        assert not torch.equal(other[0], want[0])


def test_cpu_rounds_of_any_layout_equal_the_torch_operations():
    """The CPU's general NumPy rounds (every word may vary along every axis; `random_words`'
    layout takes a faster path, checked above) against the torch ones, across chunks."""
    generator = torch.Generator().manual_seed(2)
    for shape in [(3, 17000), (40,), (2, 3, 5)]:
        inputs = torch.randint(0, 2**32, (6, *shape), generator=generator, dtype=torch.int64)
        want = philox4x32_10_torch(*inputs)
        got = philox4x32_10(*inputs)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), shape


def test_random_words_key_layout():
    """Counter = (lane block, position, stream, step); key = (seed low, seed high)."""
    seed = 0x0123456789ABCDEF
    got = random_words(torch.tensor([seed]), torch.tensor([77]), Stream.RESIDUAL, 3, step=9)
    for block in range(3):
        expected = philox_python((block, 77, int(Stream.RESIDUAL), 9), (0x89ABCDEF, 0x01234567))
        assert tuple(got[0, block].tolist()) == expected


def test_negative_seeds_use_twos_complement():
    as_signed = torch.tensor([-1], dtype=torch.int64)
    got = random_words(as_signed, torch.tensor([5]), Stream.TARGET, 1)
    assert tuple(got[0, 0].tolist()) == philox_python((0, 5, 0, 0), (0xFFFFFFFF, 0xFFFFFFFF))


def test_lane_mapping_float32_and_float64():
    """float32: lane L is word L % 4 of block L // 4; float64: lane L is the word pair
    (2 (L % 2), 2 (L % 2) + 1) of block L // 2."""
    seeds, positions = torch.tensor([3, 4]), torch.tensor([10, 11])
    raw = random_words(seeds, positions, Stream.DRAFT, 3, step=2)  # [2, 3, 4]
    u32 = uniform(seeds, positions, Stream.DRAFT, 10, step=2)
    assert torch.equal(u32, words_to_uniform32(raw.reshape(2, 12)[:, :10]))
    u64 = uniform(seeds, positions, Stream.DRAFT, 5, step=2, dtype=torch.float64)
    pairs = raw.reshape(2, 6, 2)[:, :5]
    assert torch.equal(u64, words_to_uniform64(pairs[..., 0], pairs[..., 1]))
    # fewer lanes are a prefix of more lanes
    assert torch.equal(uniform(seeds, positions, Stream.DRAFT, 3, step=2), u32[:, :3])


def test_uniform32_edges_are_strictly_inside_the_unit_interval():
    edge = words_to_uniform32(torch.tensor([0, 1, 2**32 - 1, 2**32 - 128], dtype=torch.int64))
    assert float(edge[0]) == 2.0**-33
    assert float(edge[1]) == 1.5 * 2.0**-32
    assert float(edge[2]) == UNIFORM32_MAX == 1 - 2.0**-24
    assert bool((edge > 0).all()) and bool((edge < 1).all())
    assert edge.dtype == torch.float32


def test_uniform64_edges_are_strictly_inside_the_unit_interval():
    top = torch.tensor([0, 2**32 - 1], dtype=torch.int64)
    edge = words_to_uniform64(top, top)
    assert float(edge[0]) == 2.0**-54
    assert float(edge[1]) == 1 - 2.0**-53
    assert edge.dtype == torch.float64


def test_gumbel_range_and_definition():
    """Noise reaches 22.9 at the smallest uniform (so an 18-logit gap is reachable)."""
    extremes = uniform_to_gumbel(words_to_uniform32(torch.tensor([0, 2**32 - 1])))
    assert float(extremes[0]) == pytest.approx(-math.log(2.0**-33), rel=1e-6)
    assert float(extremes[0]) > 22.8
    assert float(extremes[1]) == pytest.approx(-math.log(24 * math.log(2)), rel=1e-5)
    seeds, positions = torch.arange(4), torch.arange(4) * 3
    assert torch.equal(
        gumbel(seeds, positions, Stream.TARGET, 33, step=5),
        uniform_to_gumbel(uniform(seeds, positions, Stream.TARGET, 33, step=5)),
    )


def test_uniforms_look_uniform():
    """Deterministic keys, so this either always passes or never: a chi-square of 2**20 float32
    uniforms in 256 bins, and of the top and bottom 2**-8 in 64 finer bins."""
    from scipy import stats

    seeds = torch.arange(4096, dtype=torch.int64) * 7919
    u = uniform(seeds, torch.arange(4096), Stream.ACCEPT, 256).flatten().double()
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=256, min=0, max=1)
    assert stats.chisquare(counts.numpy()).pvalue > 1e-6
    low = u[u < 2**-8] * 2**8
    assert stats.chisquare(torch.histc(low, bins=64, min=0, max=1).numpy()).pvalue > 1e-6
    assert float(u.mean()) == pytest.approx(0.5, abs=5 * math.sqrt(1 / 12 / u.numel()))


def test_every_key_component_changes_the_draws():
    base = {"seeds": torch.tensor([5]), "positions": torch.tensor([9])}
    reference = uniform(**base, stream=Stream.DRAFT, num_lanes=8, step=3)
    variants = [
        uniform(torch.tensor([6]), base["positions"], Stream.DRAFT, 8, step=3),
        uniform(torch.tensor([5 + 2**32]), base["positions"], Stream.DRAFT, 8, step=3),
        uniform(base["seeds"], torch.tensor([10]), Stream.DRAFT, 8, step=3),
        uniform(**base, stream=Stream.ACCEPT, num_lanes=8, step=3),
        uniform(**base, stream=Stream.DRAFT, num_lanes=8, step=4),
    ]
    for variant in variants:
        assert not bool((variant == reference).any())
    # lanes within a row differ too
    assert reference.flatten().unique().numel() == 8


def test_streams_are_disjoint_for_equal_positions_and_steps():
    seeds, positions = torch.arange(64), torch.arange(64)
    fields = [uniform(seeds, positions, stream, 16) for stream in Stream]
    for i in range(len(fields)):
        for j in range(i + 1, len(fields)):
            assert not bool((fields[i] == fields[j]).any())


def test_draws_do_not_depend_on_batch_composition():
    """A row alone == in a batch == permuted == with other rows' steps and streams mixed in."""
    generator = torch.Generator().manual_seed(1)
    seeds = torch.randint(-(2**63), 2**63 - 1, (16,), generator=generator)
    positions = torch.randint(0, 2**32, (16,), generator=generator)
    steps = torch.randint(0, 2**32, (16,), generator=generator)
    streams = torch.randint(0, len(Stream), (16,), generator=generator)
    batch = uniform(seeds, positions, streams, 7, step=steps)
    perm = torch.randperm(16, generator=generator)
    assert torch.equal(
        uniform(seeds[perm], positions[perm], streams[perm], 7, step=steps[perm]), batch[perm]
    )
    for row in range(16):
        alone = uniform(
            seeds[row : row + 1],
            positions[row : row + 1],
            int(streams[row]),
            7,
            step=int(steps[row]),
        )
        assert torch.equal(alone, batch[row : row + 1])
    assert torch.equal(uniform(seeds, positions, streams, 7, step=steps), batch)  # replay


def test_scalar_and_tensor_keys_agree():
    seeds, positions = torch.arange(5), torch.arange(5) + 100
    as_int = uniform(seeds, positions, Stream.ACCEPT, 3, step=7)
    as_tensor = uniform(
        seeds, positions, torch.full((5,), int(Stream.ACCEPT)), 3, step=torch.full((5,), 7)
    )
    assert torch.equal(as_int, as_tensor)
    assert torch.equal(uniform(seeds, positions, Stream.ACCEPT, 3, step=torch.tensor(7)), as_int)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"seeds": torch.tensor([1], dtype=torch.int32)}, TypeError, "seeds"),
        ({"seeds": torch.tensor([[1]])}, ValueError, "seeds"),
        ({"positions": torch.tensor([1, 2])}, ValueError, "positions"),
        ({"positions": torch.tensor([1.0])}, TypeError, "positions"),
        ({"positions": torch.tensor([-1])}, ValueError, "positions"),
        ({"positions": torch.tensor([2**32])}, ValueError, "positions"),
        ({"step": 2**32}, ValueError, "step"),
        ({"step": -1}, ValueError, "step"),
        ({"step": torch.tensor([1, 2])}, ValueError, "step"),
        ({"stream": -1}, ValueError, "stream"),
        ({"num_lanes": 0}, ValueError, "num_lanes"),
        ({"dtype": torch.float16}, ValueError, "dtype"),
    ],
)
def test_uniform_validates_its_inputs(kwargs, error, match):
    args = {
        "seeds": torch.tensor([1]),
        "positions": torch.tensor([2]),
        "stream": Stream.TARGET,
        "num_lanes": 4,
        "step": 0,
        "dtype": torch.float32,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        uniform(
            args["seeds"],
            args["positions"],
            args["stream"],
            args["num_lanes"],
            step=args["step"],
            dtype=args["dtype"],
        )


def test_largest_keys_are_accepted():
    top = 2**32 - 1
    u = uniform(torch.tensor([2**63 - 1]), torch.tensor([top]), Stream.RESIDUAL, 2, step=top)
    assert bool((u > 0).all()) and bool((u < 1).all())
