"""Tree drafts through `Drafter.sample_draft` / `draw_children`: each node keyed by its own
counter (TREE_DRAFT at (Q, anchor, node)), a coupled request's first children on TARGET (Q),
siblings distinct, block refused."""

from __future__ import annotations

import pytest
import torch

from specdec.audit.laws import markov_toy
from specdec.drafters.base import DraftBatch
from specdec.drafters.tree import draw_children
from specdec.rng import Stream, tree_draft_stream
from specdec.sampling import SamplingTensors
from specdec.sampling import sampler as sampler_module
from tree_fixtures import ToyDrafter


def make_batch(methods):
    size = len(methods)
    return DraftBatch(
        token_ids=[[1, 2]] * size,
        seeds=torch.arange(size, dtype=torch.int64) + 40,
        anchors=torch.tensor([5, 9, 13][:size]),
        num_draft=torch.full((size,), 4),
        methods=list(methods),
        params=SamplingTensors.build(size, torch.device("cpu"), 0.9),
    )


@pytest.fixture
def noise_calls(monkeypatch):
    calls = []
    real = sampler_module.gumbel

    def spy(seeds, positions, stream, num_lanes, *, step=0):
        streams = (
            stream.tolist() if isinstance(stream, torch.Tensor) else [int(stream)] * len(seeds)
        )
        steps = step.tolist() if isinstance(step, torch.Tensor) else [step] * len(seeds)
        calls.extend(zip(seeds.tolist(), positions.tolist(), streams, steps, strict=True))
        return real(seeds, positions, stream, num_lanes, step=step)

    monkeypatch.setattr(sampler_module, "gumbel", spy)
    return calls


def test_children_keys_and_distinct_siblings(noise_calls):
    toy = markov_toy(7, key=2)
    drafter = ToyDrafter(toy)
    batch = make_batch(["standard", "coupled"])
    nodes = torch.tensor([[3, 4, 5], [0, 1, -1]])  # request 0: three children, request 1: two
    logits = toy.draft_logits[torch.tensor([1, 2])]
    positions = torch.tensor([6, 9])
    children = draw_children(drafter, logits, torch.tensor([0, 1]), positions, batch, nodes)
    assert children.token_ids[1, 2] == -1
    assert len(set(children.token_ids[0].tolist())) == 3
    assert children.token_ids[1, 0] != children.token_ids[1, 1]
    words = tree_draft_stream(torch.arange(6)).tolist()
    expected = {
        (40, 6, words[3], 5), (40, 6, words[4], 5), (40, 6, words[5], 5),  # standard: per node
        (41, 9, int(Stream.TARGET), 0),  # coupled first child: the target's own noise
        (41, 9, words[1], 9),  # coupled later children: their node's key
    }  # fmt: skip
    assert sorted(noise_calls) == sorted(expected)
    # Each child's recorded distribution excludes its earlier siblings.
    first, second = children.token_ids[0, :2].tolist()
    assert torch.isneginf(children.draft_logits[0, 1, first])
    assert torch.isneginf(children.draft_logits[0, 2, [first, second]]).all()
    assert torch.isfinite(children.draft_logits[0, 0, first])


def test_block_trees_are_refused():
    toy = markov_toy(7, key=2)
    batch = make_batch(["block"])
    with pytest.raises(ValueError, match="block verification is chain-only"):
        draw_children(
            ToyDrafter(toy), toy.draft_logits[:1], torch.tensor([0]), torch.tensor([5]), batch,
            torch.tensor([[0, 1]]),
        )  # fmt: skip


def test_greedy_children_are_the_top_tokens(noise_calls):
    toy = markov_toy(7, key=2)
    batch = make_batch(["standard"])
    children = draw_children(
        ToyDrafter(toy, greedy=True), toy.draft_logits[:1], torch.tensor([0]), torch.tensor([5]),
        batch, torch.tensor([[0, 1, 2]]),
    )  # fmt: skip
    assert children.draft_logits is None
    assert children.token_ids[0].tolist() == toy.draft_logits[0].topk(3).indices.tolist()
    assert not noise_calls
