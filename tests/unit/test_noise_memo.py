"""The CPU memo of Stream.TARGET Gumbel rows (`specdec.sampling.sampler.target_noise_memo`) and
the CPU coupled verifier that samples each request's rows only up to its first rejection: both
give exactly the values of fresh draws (bit for bit), and draw nothing they do not use."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import specdec.sampling.sampler as sampler
from specdec.rng import Stream, gumbel
from specdec.sampling import sample
from specdec.verify import verify


@pytest.fixture(autouse=True)
def empty_memo():
    sampler._NOISE_MEMO.rows.clear()
    sampler._NOISE_MEMO.bytes = 0
    yield
    sampler._NOISE_MEMO.rows.clear()
    sampler._NOISE_MEMO.bytes = 0


def test_memo_rows_are_fresh_draws_bit_for_bit_and_bounded():
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    seeds = torch.randint(-(2**62), 2**62, (6,), generator=generator)
    positions = torch.randint(0, 2**32 - 1, (6,), generator=generator)
    with mock.patch.object(sampler, "NOISE_MEMO_BYTES", 4 * vocab * 4):
        for rows in ([0, 1, 2], [2, 3], [0, 4, 5, 1], [5], [3, 3]):
            index = torch.tensor(rows)
            got = sampler.target_noise_memo(seeds[index], positions[index], Stream.TARGET, vocab)
            fresh = gumbel(seeds[index], positions[index], Stream.TARGET, vocab)
            assert torch.equal(got.view(torch.int32), fresh.view(torch.int32))
            assert sampler._NOISE_MEMO.bytes <= 4 * vocab * 4
    # other streams and round-keyed draws are not memoised
    assert sampler.target_noise_memo(seeds, positions, Stream.DRAFT, vocab) is None
    assert sampler.target_noise_memo(seeds, positions, Stream.TARGET, vocab, step=3) is None


def test_memo_draws_a_row_once():
    seeds, positions = torch.tensor([7, 7]), torch.tensor([5, 6])
    calls = []

    def counting(s, p, *args, **kwargs):
        calls.append(p.tolist())
        return gumbel(s, p, *args, **kwargs)

    with mock.patch.object(sampler, "gumbel", counting):
        sampler.target_noise_memo(seeds[:1], positions[:1], Stream.TARGET, 64)
        sampler.target_noise_memo(seeds, positions, Stream.TARGET, 64)
        sampler.target_noise_memo(seeds, positions, Stream.TARGET, 64)
    assert calls == [[5], [6]]


@pytest.mark.parametrize("temperature", [0.7, "mixed"])
def test_coupled_cpu_matches_full_sampling_and_draws_no_row_past_a_rejection(temperature):
    generator = torch.Generator().manual_seed(1)
    batch, k, vocab = 48, 3, 7
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator)
    anchors = torch.randint(0, 1000, (batch,), generator=generator)
    num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
    temps = torch.full((batch,), 0.7)
    if temperature == "mixed":
        temps[::3] = 0.0
    positions = anchors[:, None] + torch.arange(k + 1)
    own = sample(
        target_logits.reshape(-1, vocab),
        seeds.repeat_interleave(k + 1),
        positions.flatten(),
        temperature=temps.repeat_interleave(k + 1),
    ).token_ids.view(batch, k + 1)
    match = torch.minimum(torch.randint(0, k + 1, (batch,), generator=generator), num_draft)
    drafts = torch.where(torch.arange(k) < match[:, None], own[:, :k], (own[:, :k] + 1) % vocab)
    sampler._NOISE_MEMO.rows.clear()
    sampler._NOISE_MEMO.bytes = 0
    drawn = []

    def counting(s, p, *args, **kwargs):
        drawn.extend(zip(s.tolist(), p.tolist(), strict=True))
        return gumbel(s, p, *args, **kwargs)

    with mock.patch.object(sampler, "gumbel", counting):
        result = verify(
            target_logits,
            drafts,
            None,
            seeds,
            anchors,
            temperature=temps,
            num_draft=num_draft,
            method="coupled",
        )
    assert torch.equal(result.num_accepted, match)
    final = result.token_ids.gather(1, match[:, None]).squeeze(1)
    assert torch.equal(final, own.gather(1, match[:, None]).squeeze(1))
    expected = {
        (int(seeds[b]), int(anchors[b]) + j)
        for b in range(batch)
        if temps[b] > 0
        for j in range(int(match[b]) + 1)
    }
    assert sorted(drawn) == sorted(expected)


def test_memo_forgets_rows_of_a_replaced_draw_function():
    seeds, positions = torch.tensor([3]), torch.tensor([9])
    real = sampler.target_noise_memo(seeds, positions, Stream.TARGET, 32)
    with mock.patch.object(sampler, "gumbel", lambda s, p, *a, **k: torch.zeros(1, 32)):
        assert torch.equal(
            sampler.target_noise_memo(seeds, positions, Stream.TARGET, 32), torch.zeros(1, 32)
        )
    again = sampler.target_noise_memo(seeds, positions, Stream.TARGET, 32)
    assert torch.equal(again.view(torch.int32), real.view(torch.int32))
