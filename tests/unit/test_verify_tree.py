"""Tree verification (`verify_tree`) and the tree shape helpers: a chain-shaped tree is the chain
verifier bit for bit; coupled trees are plain sampling token for token and greedy trees greedy
decoding, whatever the shape; bad trees and block are refused by name."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from specdec.audit.laws import GREEDY, PROCESSINGS, markov_toy
from specdec.draft_tree import (
    ancestor_mask,
    chain_parents,
    check_parents,
    children_table,
    node_depths,
    sibling_ranks,
)
from specdec.rng import Stream, tree_draft_stream
from specdec.sampling import sample
from specdec.verify import verify_ref
from specdec.verify.tree import verify_tree
from tree_fixtures import CHAIN3, DEEP_TREE, WIDE_TREE, run_plain_requests, run_tree_requests

SHAPE = torch.tensor([[-1, -1, 0, 0, 1, 2, -1]])


def test_shape_helpers():
    assert children_table(SHAPE)[0].tolist() == [
        [0, 1, 6], [2, 3, -1], [4, -1, -1], [5, -1, -1], [-1, -1, -1], [-1, -1, -1],
        [-1, -1, -1], [-1, -1, -1],
    ]  # fmt: skip
    assert node_depths(SHAPE)[0].tolist() == [0, 0, 1, 1, 1, 2, 0]
    assert sibling_ranks(SHAPE)[0].tolist() == [0, 1, 0, 1, 0, 0, 2]
    mask = ancestor_mask(SHAPE)[0]
    assert mask[5].nonzero().squeeze(1).tolist() == [0, 2, 5]
    assert mask[4].nonzero().squeeze(1).tolist() == [1, 4]
    # Dead nodes (beyond num_nodes) are nobody's children.
    assert children_table(SHAPE, torch.tensor([4]))[0, 0].tolist() == [0, 1]
    assert chain_parents(2, 3).tolist() == [[-1, 0, 1], [-1, 0, 1]]


@pytest.mark.parametrize("parents", [[[0, -1]], [[-1, 1]], [[-2, 0]], [[-1, 0, 2]]], ids=str)
def test_bad_parents_are_refused(parents):
    with pytest.raises(ValueError, match="parents"):
        check_parents(torch.tensor(parents))


def random_round(generator, batch, k, vocab, temperature, method):
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator) * 2
    raw_draft = torch.randn(batch, k, vocab, generator=generator) * 2
    seeds = torch.arange(batch, dtype=torch.int64) * 7 + 1
    positions = torch.full((batch,), 10, dtype=torch.int64)
    stream = Stream.TARGET if method == "coupled" else Stream.DRAFT
    drafts = [
        sample(
            raw_draft[:, i],
            seeds,
            positions + i,
            temperature=temperature,
            top_k=5,
            stream=stream,
            step=0 if method == "coupled" else positions,
        )
        for i in range(k)
    ]
    tokens = torch.stack([d.token_ids for d in drafts], dim=1)
    logits = None if temperature == 0 else torch.stack([d.processed_logits for d in drafts], 1)
    return target_logits, tokens, logits, seeds, positions


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_chain_shaped_tree_is_the_chain_verifier(method, temperature):
    generator = torch.Generator().manual_seed(0)
    batch, k, vocab = 128, 4, 12
    target_logits, tokens, logits, seeds, positions = random_round(
        generator, batch, k, vocab, temperature, method
    )
    num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
    kwargs = {"temperature": temperature, "top_k": 5, "method": method}
    chain = verify_ref(
        target_logits, tokens, logits, seeds, positions, num_draft=num_draft, **kwargs
    )
    tree = verify_tree(
        target_logits,
        chain_parents(batch, k),
        tokens,
        logits,
        seeds,
        positions,
        num_nodes=num_draft,
        **kwargs,
    )
    assert torch.equal(tree.token_ids, chain.token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    columns = torch.arange(k)[None, :]
    expected_nodes = torch.where(columns < chain.num_accepted[:, None], columns, -1)
    assert torch.equal(tree.accepted_nodes, expected_nodes)


@pytest.mark.parametrize("processing", PROCESSINGS[:3], ids=lambda p: p.name)
@pytest.mark.parametrize("shape", [WIDE_TREE, DEEP_TREE, CHAIN3], ids=["wide", "deep", "chain"])
def test_coupled_trees_are_plain_sampling_token_for_token(shape, processing):
    toy = markov_toy(5, key=3)
    tree, accepted, _ = run_tree_requests(toy, processing, shape, "coupled", 500, 8, seed=4)
    plain = run_plain_requests(toy, processing, 500, 8, seed=4)
    assert torch.equal(tree, plain)
    assert float(accepted.float().mean()) > 0.5


@pytest.mark.parametrize("greedy_drafts", [True, False])
@pytest.mark.parametrize("method", ["standard", "coupled"])
@pytest.mark.parametrize("shape", [WIDE_TREE, DEEP_TREE], ids=["wide", "deep"])
def test_greedy_trees_are_greedy_decoding(shape, method, greedy_drafts):
    toy = markov_toy(6, key=5)
    tree, _, rounds = run_tree_requests(
        toy, GREEDY, shape, method, 64, 10, seed=6, greedy_drafts=greedy_drafts
    )
    plain = run_plain_requests(toy, GREEDY, 64, 10, seed=6)
    assert torch.equal(tree, plain)
    assert int(rounds.max()) < 10  # some rounds accepted drafts


def test_accepted_nodes_form_a_root_path():
    toy = markov_toy(5, key=3)
    shape = torch.tensor(DEEP_TREE)
    from specdec.drafters.base import DraftBatch
    from specdec.sampling import SamplingTensors
    from tree_fixtures import ToyDrafter, draw_tree

    size = 256
    batch = DraftBatch(
        token_ids=[[0]] * size,
        seeds=torch.arange(size, dtype=torch.int64),
        anchors=torch.full((size,), 3, dtype=torch.int64),
        num_draft=torch.full((size,), shape.numel()),
        methods=["standard"] * size,
        params=SamplingTensors.build(size, torch.device("cpu"), 1.0),
    )
    last = torch.zeros(size, dtype=torch.int64)
    tokens, logits = draw_tree(ToyDrafter(toy), shape, last, batch)
    # Siblings are distinct tokens (drawn without replacement).
    for parent in set(DEEP_TREE):
        kids = [n for n, p in enumerate(DEEP_TREE) if p == parent]
        if len(kids) > 1:
            picked = tokens[:, kids]
            assert bool((picked[:, :1] != picked[:, 1:]).all())
    before = torch.cat([last[:, None], tokens], dim=1)
    result = verify_tree(
        toy.target_logits[before], shape.expand(size, -1), tokens, logits,
        batch.seeds, batch.anchors, temperature=1.0,
    )  # fmt: skip
    for b in range(size):
        path = result.accepted_nodes[b, : int(result.num_accepted[b])].tolist()
        parent = -1
        for node in path:
            assert DEEP_TREE[node] == parent
            parent = node
        assert result.token_ids[b, : len(path)].tolist() == tokens[b, path].tolist()
        assert int(result.token_ids[b, len(path)]) >= 0
    assert int(result.num_accepted.max()) >= 3


def test_block_and_unknown_methods_are_refused():
    target_logits = torch.zeros(1, 3, 4)
    tokens = torch.zeros(1, 2, dtype=torch.int64)
    args = (target_logits, chain_parents(1, 2), tokens, None, torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="block verification is chain-only"):
        verify_tree(*args, temperature=1.0, method="block")
    with pytest.raises(ValueError, match="tree method"):
        verify_tree(*args, temperature=1.0, method="typical")
    with pytest.raises(ValueError, match="parents must have the shape"):
        verify_tree(target_logits, chain_parents(1, 3), *args[2:], temperature=1.0)


def test_tree_draft_stream_words_are_disjoint():
    words = tree_draft_stream(torch.arange(4))
    assert words.tolist() == [6, 6 + 256, 6 + 512, 6 + 768]
    assert not set(words.tolist()) & {int(s) for s in Stream if s != Stream.TREE_DRAFT}
    with pytest.raises(ValueError, match="tree node"):
        tree_draft_stream(torch.tensor([2**24]))


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("shape", ["wide", "deep", "chain"])
@pytest.mark.parametrize(
    "method, temperature, sampled, top_k",
    [
        ("standard", 0.9, True, None),
        ("standard", 0.9, True, 20),
        ("standard", 0.9, False, None),
        ("standard", 0.0, False, None),
        ("coupled", 0.9, True, None),
        ("coupled", 0.0, False, None),
    ],
)
def test_triton_tree_walk_interpreted_matches_twin(shape, method, temperature, sampled, top_k):
    """The Triton tree walk under Triton's CPU interpreter equals `verify_tree_ref` token for
    token on the same prepared inputs (V = 37, 16 requests)."""
    from specdec.verify.inputs import check_verify_inputs
    from specdec.verify.tree import prepare_tree, verify_tree_ref
    from specdec.verify.tree_triton import verify_tree_triton
    from tree_fixtures import PARITY_SHAPES, near_round

    generator = torch.Generator().manual_seed(37 + len(PARITY_SHAPES[shape]))
    target, tokens, draft_logits, seeds, positions, num_nodes, parents = near_round(
        generator, PARITY_SHAPES[shape], 16, 37, temperature, sampled, top_k
    )
    inputs = check_verify_inputs(
        target, tokens, draft_logits, seeds, positions,
        temperature=temperature, top_k=top_k, num_draft=num_nodes, method=method,
    )  # fmt: skip
    prepared = prepare_tree(inputs, parents)
    ref, got = verify_tree_ref(prepared), verify_tree_triton(prepared)
    assert torch.equal(got.token_ids, ref.token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert torch.equal(got.accepted_nodes, ref.accepted_nodes)
