"""Draft-model trees (`drafters/draft_model_tree.py`) on the CPU: every node's children are drawn
from the draft model's own distribution after the path to that node, i.e. the logits of a plain
causal run over the prefix and the node's ancestors (the tree step's mask and positions are
right); the same check fails when the tree step attends causally over the nodes in drafting
order (the negative control). Sampled drafts' recorded distributions are those logits."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import prompt_tokens, seeded_model
from specdec.drafters import draft_model_tree
from specdec.drafters.base import DraftBatch
from specdec.drafters.config import TreeConfig
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.runner import StepInput
from specdec.sampling import SamplingTensors

TREE = TreeConfig(nodes=10, depth=4, topk=2)


def _drafter(model, greedy: bool) -> DraftModelDrafter:
    vocab = model.config.vocab_size
    return DraftModelDrafter(model, vocab, 64, 4, greedy=greedy, max_num_seqs=2, tree=TREE)


def _batch(prompts) -> DraftBatch:
    size = len(prompts)
    return DraftBatch(
        token_ids=[list(p) for p in prompts],
        seeds=torch.arange(size, dtype=torch.int64) + 3,
        anchors=torch.tensor([len(p) for p in prompts]),
        num_draft=torch.full((size,), TREE.nodes),
        methods=["standard"] * size,
        params=SamplingTensors.build(size, torch.device("cpu"), 1.0),
        request_ids=[f"r{b}" for b in range(size)],
    )


def _path(parents: list[int], node: int) -> list[int]:
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


def _causal_logits(model, tokens: list[int]) -> torch.Tensor:
    """The draft model's logits after `tokens`, from a fresh causal run (its own runner)."""
    fresh = DraftModelDrafter(model, model.config.vocab_size, 64, 4, max_num_seqs=1)
    blocks = list(range(-(-len(tokens) // 4)))
    (logits,) = fresh.runner.run([StepInput(tokens, 0, blocks, 1)])
    return logits[0]


def _check(model, greedy: bool) -> float:
    """Largest gap between a node's children's distribution and the causal logits after the
    path to it (log-softmax), over every parent with children; greedy: the children are the
    causal top tokens."""
    drafter = _drafter(model, greedy)
    prompts = prompt_tokens(model.config.vocab_size, [6, 9], seed=2)
    batch = _batch(prompts)
    proposal = drafter.propose(batch)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        count = int(proposal.num_draft[b])
        parents = proposal.tree_parents[b, :count].tolist()
        tokens = proposal.draft_token_ids[b, :count].tolist()
        assert count == TREE.nodes and max(parents) >= 0  # a tree, not only the root's children
        for parent in sorted(set(parents)):
            children = [n for n in range(count) if parents[n] == parent]
            prefix = list(prompt) + [
                tokens[n] for n in (_path(parents, parent) if parent >= 0 else [])
            ]
            want = _causal_logits(model, prefix).log_softmax(-1)
            if greedy:
                top = want.topk(len(children)).indices.tolist()
                worst = max(worst, 0.0 if [tokens[n] for n in children] == top else 1.0)
            else:
                first = children[0]  # the first child's distribution excludes no sibling
                got = proposal.draft_logits[b, first].log_softmax(-1)
                worst = max(worst, float((got - want).abs().max()))
    return worst


@pytest.mark.parametrize("greedy", [False, True])
def test_children_follow_the_draft_model_after_the_path(greedy):
    model = seeded_model("llama", "cpu")
    assert _check(model, greedy) < 1e-4


def test_a_causal_tree_step_is_caught(monkeypatch):
    """Negative control: the tree step run causally over the nodes (no tree mask, positions in
    drafting order) gives children that do not follow their paths."""
    model = seeded_model("llama", "cpu")
    real = StepInput

    def causal(tokens, start, blocks, rows, tree_parents=None):
        return real(tokens, start, blocks, rows, None)

    monkeypatch.setattr(draft_model_tree, "StepInput", causal)
    assert _check(model, greedy=False) > 1e-2
