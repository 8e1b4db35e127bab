"""Drafter base: draft noise has one call site, keyed by (Q, stream by method); n-gram lookup."""

import torch

from specdec.drafters import DraftBatch, Drafter, NgramDrafter, ngram_lookup
from specdec.drafters import base as drafter_base
from specdec.rng import Stream
from specdec.sampling import SamplingTensors, sample_ref


class ConstantDrafter(Drafter):
    """Proposes from fixed logits; used to watch what the base class does."""

    def __init__(self, logits, draft_to_target=None, target_vocab_size=None):
        super().__init__(target_vocab_size or logits.shape[-1], draft_to_target)
        self.logits = logits

    def propose(self, batch):  # pragma: no cover - not needed here
        raise AssertionError


def make_batch(methods, temperature=1.0):
    b = len(methods)
    return DraftBatch(
        token_ids=[[1, 2, 3]] * b,
        seeds=torch.arange(10, 10 + b),
        anchors=torch.tensor([3, 8, 20][:b]),
        num_draft=torch.full((b,), 2),
        methods=list(methods),
        params=SamplingTensors.build(b, torch.device("cpu"), temperature),
    )


def test_sample_draft_keys_by_position_and_method(monkeypatch):
    calls = []

    def spy(logits, seeds, positions, *, check_values=True, **kwargs):
        assert not check_values  # the engine's parameters: no read-back checks on the device
        calls.append((positions.tolist(), kwargs["stream"], kwargs["step"]))
        return sample_ref(logits, seeds, positions, **kwargs)

    monkeypatch.setattr(drafter_base, "sample", spy)
    batch = make_batch(["standard", "coupled", "block"])
    drafter = ConstantDrafter(torch.zeros(3, 6))
    positions = torch.tensor([3, 8, 20])  # Q of each proposed token
    drafter.sample_draft(torch.randn(3, 6), torch.arange(3), positions, batch)
    by_stream = {stream: (pos, step) for pos, stream, step in calls}
    assert by_stream[Stream.TARGET] == ([8], 0)
    pos, step = by_stream[Stream.DRAFT]
    assert pos == [3, 20] and step.tolist() == [3, 20]


def test_sample_draft_matches_direct_sampling_and_returns_what_it_sampled():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, generator=gen)
    batch = make_batch(["standard", "standard"], temperature=0.7)
    out = ConstantDrafter(logits).sample_draft(logits, torch.arange(2), torch.tensor([3, 8]), batch)
    direct = sample_ref(
        logits,
        batch.seeds,
        torch.tensor([3, 8]),
        temperature=0.7,
        stream=Stream.DRAFT,
        step=batch.anchors,
    )
    assert torch.equal(out.token_ids, direct.token_ids)
    assert torch.equal(out.processed_logits, direct.processed_logits)


def test_reduced_vocabulary_maps_to_target_ids():
    draft_to_target = torch.tensor([5, 0, 7])
    drafter = ConstantDrafter(torch.zeros(1, 3), draft_to_target, target_vocab_size=10)
    logits = torch.tensor([[0.0, -1.0, 3.0]])
    batch = make_batch(["standard"], temperature=0.0)
    out = drafter.sample_draft(logits, torch.arange(1), torch.tensor([3]), batch)
    assert out.token_ids.tolist() == [7]
    row = out.processed_logits[0]
    assert torch.isneginf(row[[1, 2, 3, 4, 6, 8, 9]]).all()
    assert row[[5, 0, 7]].tolist() == [0.0, -1.0, 3.0]


def test_ngram_lookup_prefers_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert ngram_lookup(tokens, 2, 1, 3) == [4, 5]  # latest "1 2 3" is followed by 4 5
    assert ngram_lookup([1, 2, 3], 2, 1, 3) == []
    assert ngram_lookup([7, 8, 7], 3, 1, 2) == [8, 7]


def test_ngram_drafter_proposal_is_one_hot_and_ragged():
    batch = DraftBatch(
        token_ids=[[1, 2, 1], [4, 5, 6]],
        seeds=torch.tensor([1, 2]),
        anchors=torch.tensor([3, 3]),
        num_draft=torch.tensor([3, 3]),
        methods=["standard", "coupled"],
        params=SamplingTensors.build(2, torch.device("cpu"), 1.0),
    )
    proposal = NgramDrafter(10).propose(batch)
    assert proposal.draft_logits is None
    assert proposal.num_draft.tolist() == [2, 0]
    assert proposal.draft_token_ids.tolist() == [[2, 1, -1], [-1, -1, -1]]


def test_the_drafter_table_covers_every_method():
    """One class per `speculative_config.method`, and every class builds through from_config."""
    from specdec.drafters.config import SPECULATIVE_METHODS
    from specdec.drafters.registry import DRAFTERS

    assert tuple(DRAFTERS) == SPECULATIVE_METHODS
    assert all(cls.from_config is not Drafter.from_config for cls in DRAFTERS.values())
