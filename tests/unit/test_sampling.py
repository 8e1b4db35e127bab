"""Unit tests of specdec.sampling: SamplingParams, logits processing, and Gumbel-max `sample`."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from specdec.rng import Stream, gumbel
from specdec.sampling import SamplingParams, process_logits, sample

# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "1.0"},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"top_k": -2},
        {"top_k": 2.0},
        {"top_k": True},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"seed": 1.0},
        {"seed": True},
        {"max_tokens": 0},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"stop": ""},
        {"stop": ["ok", ""]},
        {"stop_token_ids": [-1]},
        {"logprobs": -1},
    ],
)
def test_sampling_params_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sampling_params_normalises():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0).temperature == 0.0
    assert SamplingParams(stop="</s>").stop == ["</s>"]
    assert SamplingParams(seed=2**64 - 1).seed64 == -1
    assert SamplingParams(seed=5).seed64 == 5
    assert SamplingParams().seed64 is None
    with pytest.warns(UserWarning, match="clamped"):
        assert SamplingParams(temperature=0.005).temperature == 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not SamplingParams(temperature=0.7).greedy


# ---------------------------------------------------------------------------------------------
# Processing
# ---------------------------------------------------------------------------------------------


def rows(value, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)


def support(processed: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in processed]


def oracle_support(scaled: list[float], top_k: int, top_p: float, min_p: float) -> list[int]:
    """Float64 reference in vLLM's order: min-p, then top-k (ties kept), then top-p on the law
    those leave (keep the most likely tokens while the mass before them is < top_p; ties kept)."""
    vocab = len(scaled)
    keep = set(range(vocab))
    if min_p > 0:
        floor = max(scaled) + math.log(min_p)
        keep = {v for v in keep if scaled[v] >= floor}
    if 0 < top_k < vocab:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = {v for v in keep if scaled[v] >= kth}
    if top_p < 1:
        order = sorted(keep, key=lambda v: -scaled[v])
        weights = [math.exp(scaled[v] - scaled[order[0]]) for v in order]
        total, before, last = sum(weights), 0.0, order[0]
        for v, w in zip(order, weights, strict=True):
            if before / total >= top_p:
                break
            last, before = v, before + w
        keep = {v for v in keep if scaled[v] >= scaled[last]}
    return sorted(keep)


def test_temperature_scales_and_greedy_rows_are_unscaled():
    logits = torch.tensor([[1.0, 2.0, -3.0], [1.0, 2.0, -3.0], [4.0, 0.0, 1.0]])
    out = process_logits(logits, torch.tensor([0.5, 0.0, 2.0]))
    assert torch.equal(out, torch.tensor([[2.0, 4.0, -6.0], [1.0, 2.0, -3.0], [2.0, 0.0, 0.5]]))
    assert out.dtype == torch.float32
    assert process_logits(logits.bfloat16(), torch.ones(3)).dtype == torch.float32


def test_top_k_keeps_the_k_largest_and_all_ties():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0], [0.0, 5.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    out = process_logits(logits, rows(1.0, 3), top_k=torch.tensor([2, 2, 1]))
    assert support(out) == [[0, 1, 2], [1, 3], [0, 1, 2, 3]]
    assert torch.equal(out[1, [1, 3]], logits[1, [1, 3]])
    for off in (0, 4, 9):
        assert torch.equal(
            process_logits(logits, rows(1.0, 3), top_k=rows(off, 3, torch.int64)), logits
        )


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4, 4)
    out = process_logits(logits, rows(1.0, 4), top_p=torch.tensor([0.75, 0.85, 0.01, 1.0]))
    assert support(out) == [[0, 1], [0, 1, 2], [0], [0, 1, 2, 3]]


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3, 4)
    out = process_logits(logits, rows(1.0, 3), min_p=torch.tensor([0.2, 0.5, 0.0]))
    assert support(out) == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_filters_apply_to_temperature_scaled_logits():
    """At T = 2 the law flattens, so top-p 0.75 and min-p 0.5 keep more tokens than at T = 1."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2, 4)
    out = process_logits(
        logits,
        torch.tensor([2.0, 2.0]),
        top_p=torch.tensor([0.75, 1.0]),
        min_p=torch.tensor([0.0, 0.5]),
    )
    assert support(out) == [[0, 1, 2], [0, 1, 2]]  # at T = 1: [[0, 1], [0, 1]]


def test_processing_matches_a_float64_oracle_on_random_rows():
    generator = torch.Generator().manual_seed(0)
    num_rows, vocab = 400, 12
    logits = 2 * torch.randn(num_rows, vocab, generator=generator)
    temperature = torch.rand(num_rows, generator=generator) * 1.5 + 0.2
    top_k = torch.randint(0, vocab + 2, (num_rows,), generator=generator)
    top_p = torch.where(
        torch.rand(num_rows, generator=generator) < 0.3,
        1.0,
        torch.rand(num_rows, generator=generator) * 0.9 + 0.05,
    )
    min_p = torch.where(
        torch.rand(num_rows, generator=generator) < 0.5,
        0.0,
        torch.rand(num_rows, generator=generator) * 0.5,
    )
    out = process_logits(logits, temperature, top_k, top_p, min_p)
    scaled = logits / temperature[:, None]
    for row in range(num_rows):
        expected = oracle_support(
            scaled[row].double().tolist(), int(top_k[row]), float(top_p[row]), float(min_p[row])
        )
        assert support(out[row : row + 1])[0] == expected, row
        kept = torch.isfinite(out[row])
        assert torch.equal(out[row, kept], scaled[row, kept])


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------


def keys(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.int64) * 1000003, torch.arange(n, dtype=torch.int64) + 5


def test_greedy_rows_take_the_argmax_with_ties_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 5.0, 2.0]])
    seeds, positions = keys(2)
    out = sample(logits, seeds, positions, temperature=0.0)
    assert out.token_ids.tolist() == [1, 0]


def test_sample_is_gumbel_max_on_the_processed_logits():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 10, generator=generator)
    seeds, positions = keys(64)
    params = {"temperature": torch.linspace(0.3, 1.5, 64), "top_k": 6, "top_p": 0.9, "min_p": 0.05}
    for stream, step in ((Stream.TARGET, 0), (Stream.DRAFT, positions)):
        out = sample(logits, seeds, positions, **params, stream=stream, step=step)
        processed = process_logits(
            logits,
            params["temperature"],
            torch.full((64,), 6),
            torch.full((64,), 0.9),
            torch.full((64,), 0.05),
        )
        assert torch.equal(out.processed_logits, processed)
        assert torch.equal(out.logsumexp, processed.logsumexp(dim=-1))
        noise = gumbel(seeds, positions, stream, 10, step=step)
        assert torch.equal(out.token_ids, (processed + noise).argmax(dim=-1))
        assert bool(torch.isfinite(processed.gather(1, out.token_ids[:, None])).all())


def test_sample_writes_into_strided_columns_of_a_proposal():
    """`out=` (one column of [N, K, V] / [N, K] proposal buffers) holds what `sample` returns
    without it, and nothing else in the buffers changes; a misshapen `out` is refused."""
    from specdec.sampling import SampleOutput

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 11, generator=generator)
    seeds, positions = keys(8)
    params = {"temperature": torch.linspace(0.0, 1.5, 8), "top_k": 5}
    want = sample(logits, seeds, positions, **params)
    ids, lse = torch.full((8, 3), -1), torch.zeros(8, 3)
    proposal = torch.full((8, 3, 11), float("-inf"))
    column = SampleOutput(ids[:, 1], proposal[:, 1], lse[:, 1])
    got = sample(logits, seeds, positions, **params, out=column)
    assert got is column
    assert torch.equal(ids[:, 1], want.token_ids)
    assert torch.equal(proposal[:, 1], want.processed_logits)
    assert torch.equal(lse[:, 1], want.logsumexp)
    assert (ids[:, [0, 2]] == -1).all() and (proposal[:, [0, 2]] == float("-inf")).all()
    wrong = SampleOutput(ids[:4, 0], proposal[:, 0], lse[:, 0])
    with pytest.raises(ValueError, match=r"out\.token_ids"):
        sample(logits, seeds, positions, **params, out=wrong)


def test_sample_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5]]).expand(6, 3)
    seeds, positions = keys(6)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    out = sample(logits, seeds, positions, temperature=temperature)
    alone = sample(logits[1::2], seeds[1::2], positions[1::2], temperature=1.0)
    assert out.token_ids[0::2].tolist() == [1, 1, 1]
    assert torch.equal(out.token_ids[1::2], alone.token_ids)


def test_sample_stays_inside_the_support():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2000, 8, generator=generator)
    seeds, positions = keys(2000)
    out = sample(logits, seeds, positions, temperature=1.0, top_k=2)
    top2 = logits.topk(2, dim=-1).indices
    assert bool((top2 == out.token_ids[:, None]).any(dim=-1).all())


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"logits": torch.zeros(4)}, ValueError, "logits"),
        ({"logits": torch.zeros(2, 4, dtype=torch.int64)}, TypeError, "logits"),
        ({"seeds": torch.zeros(2, dtype=torch.int32)}, TypeError, "seeds"),
        ({"seeds": torch.zeros(3, dtype=torch.int64)}, ValueError, "seeds"),
        ({"positions": torch.tensor([0, -1])}, ValueError, "positions"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": None}, ValueError, "temperature"),
        ({"temperature": torch.ones(3)}, ValueError, "temperature"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"min_p": 1.5}, ValueError, "min_p"),
    ],
)
def test_sample_validates_its_inputs(change, error, match):
    args = {
        "logits": torch.zeros(2, 4),
        "seeds": torch.zeros(2, dtype=torch.int64),
        "positions": torch.zeros(2, dtype=torch.int64),
        "temperature": 1.0,
    }
    args.update(change)
    logits, seeds, positions = args.pop("logits"), args.pop("seeds"), args.pop("positions")
    with pytest.raises(error, match=match):
        sample(logits, seeds, positions, **args)


def test_readback_returns_every_named_value_bit_for_bit():
    """The packed copy behind the asynchronous argument checks: int64 values exactly, float32
    values bit for bit (NaN, infinities, -0.0 included), None entries absent."""
    from specdec.transfer import Readback

    ints = {"a": torch.tensor([0, -1, 2**40]), "none": None, "b": torch.tensor([[3], [4]])}
    floats = {
        "x": torch.tensor([float("nan"), float("-inf"), -0.0, 1e-30], dtype=torch.float32),
        "gone": None,
        "y": torch.tensor([2.5], dtype=torch.float64),
    }
    values = Readback(ints, floats).values()
    assert set(values) == {"a", "b", "x", "y"}
    assert torch.equal(values["a"], ints["a"]) and torch.equal(values["b"], torch.tensor([3, 4]))
    assert torch.equal(values["x"].view(torch.int32), floats["x"].view(torch.int32))
    assert values["y"].dtype == torch.float32 and values["y"].tolist() == [2.5]
