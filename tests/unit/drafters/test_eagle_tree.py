"""EAGLE tree drafting: every node drawn through `sample_draft` with its own key (TREE_DRAFT at
(Q = anchor + depth, anchor, node)), a coupled request's first children on TARGET (Q); the
grown trees respect the node budget, depth and top-k, and siblings are distinct tokens."""

from __future__ import annotations

import inspect

import pytest
import torch

from drafter_format_fixtures import cpu_draft_batch, observe_prefixes
from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, save_hf_model
from specdec.draft_tree import check_parents, node_depths, sibling_ranks
from specdec.drafters import DrafterSetup
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.models import load_model
from specdec.rng import Stream, tree_draft_stream
from specdec.sampling import sampler as sampler_module

TOKENS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
ANCHORS = [6, 3, 8]
TREE = {"nodes": 7, "depth": 3, "topk": 2}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target_dir = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))
    return target_dir, trained_head(target_dir, tmp_path_factory.mktemp("eagle"), steps=5)


def fed_tree_drafter(dirs, greedy=False):
    target_dir, head_dir = dirs
    target = load_model(target_dir).model
    spec = SpeculativeConfig(
        method="eagle",
        model=str(head_dir),
        draft_sample_method="greedy" if greedy else "probabilistic",
        tree=TREE,
    )
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = EagleDrafter.from_config(spec, target, setup)
    drafter._graphs = None
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    methods = ["standard", "coupled", "standard"]
    batch = cpu_draft_batch(TOKENS, ANCHORS, [11, -22, 33], [7, 5, 7], methods, 0.9, ids)
    return drafter, batch


@pytest.fixture
def noise_calls(monkeypatch):
    calls = []
    real = sampler_module.gumbel

    def spy(seeds, positions, stream, num_lanes, *, step=0):
        callers = [frame.function for frame in inspect.stack()[1:8]]
        assert "sample_draft" in callers
        n = len(seeds)
        streams = stream.tolist() if isinstance(stream, torch.Tensor) else [int(stream)] * n
        steps = step.tolist() if isinstance(step, torch.Tensor) else [step] * n
        calls.extend(zip(seeds.tolist(), positions.tolist(), streams, steps, strict=True))
        return real(seeds, positions, stream, num_lanes, step=step)

    monkeypatch.setattr(sampler_module, "gumbel", spy)
    return calls


def test_tree_nodes_are_keyed_per_node(dirs, noise_calls):
    drafter, batch = fed_tree_drafter(dirs)
    proposal = drafter.propose(batch)
    parents = proposal.tree_parents
    assert proposal.num_draft.tolist() == [7, 5, 7]
    check_parents(parents, proposal.num_draft)
    depths, ranks = node_depths(parents), sibling_ranks(parents, proposal.num_draft)
    expected = []
    for b in range(3):
        seed, anchor = int(batch.seeds[b]), ANCHORS[b]
        for node in range(int(proposal.num_draft[b])):
            position = anchor + int(depths[b, node])
            if batch.methods[b] == "coupled" and int(ranks[b, node]) == 0:
                expected.append((seed, position, int(Stream.TARGET), 0))
            else:
                word = int(tree_draft_stream(torch.tensor([node]))[0])
                expected.append((seed, position, word, anchor))
            token = int(proposal.draft_token_ids[b, node])
            assert torch.isfinite(proposal.draft_logits[b, node, token])
        assert int(depths[b, : int(proposal.num_draft[b])].max()) < TREE["depth"]
        for parent in range(-1, int(proposal.num_draft[b])):
            kids = [n for n in range(int(proposal.num_draft[b])) if int(parents[b, n]) == parent]
            assert len(kids) <= TREE["topk"]
            tokens = proposal.draft_token_ids[b, kids].tolist()
            assert len(set(tokens)) == len(tokens)
    assert sorted(noise_calls) == sorted(expected)


def test_greedy_tree_takes_the_top_tokens_without_noise(dirs, noise_calls):
    drafter, batch = fed_tree_drafter(dirs, greedy=True)
    proposal = drafter.propose(batch)
    assert proposal.draft_logits is None and noise_calls == []
    assert proposal.num_draft.tolist() == [7, 5, 7]
