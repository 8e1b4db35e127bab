"""Tree drafts through `Drafter.sample_draft` / `draw_children`: each node keyed by its own
counter (TREE_DRAFT at (Q, anchor, node)), a coupled request's first children on TARGET (Q),
siblings distinct, block refused."""

from __future__ import annotations

import dataclasses

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


def _grow(toy, drafter, batch, tree, live, last_tokens):
    """Grows the trees of `live` requests the way the EAGLE / draft-model loops do, the toy's
    bigram logits after each node; returns (trees, out, the (node, offered children) of each
    step: the children each expanded parent offered, before the step chose)."""
    from types import SimpleNamespace

    from specdec.drafters.tree import draw_level, expand_frontier, start_trees

    size, vocab = batch.batch_size, toy.vocab_size
    out = SimpleNamespace(
        draft_token_ids=torch.full((size, tree.nodes), -1, dtype=torch.int64),
        draft_logits=torch.full((size, tree.nodes, vocab), float("-inf")),
        draft_logsumexp=torch.zeros(size, tree.nodes),
    )
    trees = start_trees(batch, tree, live)
    parents_rows = [(b, -1) for b in live]
    tokens = [int(last_tokens[b]) for b in live]
    steps = []
    for depth in range(tree.depth):
        logits = toy.draft_logits[torch.tensor(tokens)]
        before = {b: len(trees[b].parents) for b in live}
        draw_level(drafter, batch, trees, parents_rows, logits, None, depth, tree, out)
        steps.append((parents_rows, logits, before))
        if depth + 1 == tree.depth:
            break
        parents_rows = expand_frontier(trees, depth, tree.topk)
        if not parents_rows:
            break
        tokens = [trees[b].tokens[n] for b, n in parents_rows]
    return trees, out, steps


def test_greedy_requests_grow_best_first_and_sampled_ones_level_by_level(noise_calls):
    """A temperature-0 request's tree: each step, the `wave` offered candidates of highest
    cumulative draft log-probability become nodes (none left behind beats a chosen one), the
    nodes' cumulative log-probabilities add up along their paths, node order is topological,
    and no noise is drawn. A sampled request in the same batch keeps the level-by-level tree."""
    from specdec.drafters.config import TreeConfig

    toy = markov_toy(7, key=2)
    drafter = ToyDrafter(toy)
    temperatures = SamplingTensors.build(2, torch.device("cpu"), torch.tensor([0.0, 0.9]))
    batch = dataclasses.replace(
        make_batch(["standard", "coupled"]), params=temperatures, num_draft=torch.tensor([9, 9])
    )
    tree = TreeConfig(nodes=9, depth=4, topk=2)
    trees, out, steps = _grow(toy, drafter, batch, tree, [0, 1], torch.tensor([3, 3]))
    greedy, sampled = trees[0], trees[1]
    # 9 // 4 = 2 nodes a step, the last step the 3 left; each new node offers its top 3.
    assert (greedy.wave, greedy.offer, sampled.wave) == (2, 3, 0)
    assert len(greedy.parents) == 9
    log_probs = toy.draft_logits.log_softmax(-1)
    for node, parent in enumerate(greedy.parents):
        assert parent < node
        before = 3 if parent < 0 else greedy.tokens[parent]
        base = 0.0 if parent < 0 else greedy.cum_logp[parent]
        expected = base + float(log_probs[before, greedy.tokens[node]])
        assert greedy.cum_logp[node] == pytest.approx(expected, abs=1e-5)
        assert out.draft_token_ids[0, node] == greedy.tokens[node]
    # Every candidate offered up to a step and not taken by then is no better than what that
    # step took (each expanded parent offers its top `wave` children).
    offered, taken_steps = [], []  # (cum_logp, parent, token); nodes each step took
    for parents_rows, logits, before in steps:
        for row, (b, parent) in enumerate(parents_rows):
            if b != 0:
                continue
            base = 0.0 if parent < 0 else greedy.cum_logp[parent]
            top = logits[row].log_softmax(-1).topk(greedy.offer)
            offered += [(base + float(v), parent, int(t)) for v, t in zip(*top, strict=True)]
        start = before[0]
        step_size = greedy.wave if len(taken_steps) < tree.depth - 1 else greedy.budget - start
        taken_steps.append(step_size)
        taken_now = list(range(start, min(start + step_size, len(greedy.parents))))
        taken = {(greedy.parents[n], greedy.tokens[n]) for n in range(taken_now[-1] + 1)}
        left = [c for c in offered if (c[1], c[2]) not in taken]
        if left and taken_now:
            assert min(greedy.cum_logp[n] for n in taken_now) >= max(c[0] for c in left) - 1e-6
    # The sampled request's tree: 2 nodes on level 1 and 4 on each later level.
    assert sampled.depths == [0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert taken_steps == [2, 2, 2, 3]
    # With a confident draft (token t -> t + 1 far ahead) a greedy tree runs four levels deep,
    # past the three levels the level-by-level growth allows 9 nodes.
    vocab = toy.vocab_size
    peaked = toy.draft_logits.clone()
    peaked[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] += 8.0
    sure = dataclasses.replace(toy, draft_logits=peaked)
    trees, _, _ = _grow(sure, ToyDrafter(sure), batch, tree, [0, 1], torch.tensor([3, 3]))
    assert max(trees[0].depths) == 3 and max(trees[1].depths) == 2
    chain = [n for n, d in enumerate(trees[0].depths) if trees[0].tokens[n] == (4 + d) % vocab]
    assert [trees[0].depths[n] for n in chain] == [0, 1, 2, 3]
    assert {call[0] for call in noise_calls} == {int(batch.seeds[1])}  # the sampled one only
