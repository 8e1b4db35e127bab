"""Medusa trees from the heads' top-k: a node at depth d holds a token of head d's (at
Q = A + d), drawn through `sample_draft` with its own key (TREE_DRAFT at (Q, anchor, node); a
coupled request's first children on TARGET at Q), siblings without replacement, and the
recorded distribution is the one it was drawn from; a greedy drafter takes each head's top
tokens without noise; trees are no deeper than the heads. Through `LLM`: greedy trees emit
greedy decoding's tokens, coupled trees plain sampling's, and the engine's law holds for
standard and coupled trees (with a negative control).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from law_fixtures import exact_continuation_law, first_token_counts, save_vocab8_target
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import medusa_config, medusa_tensors, random_tensors, write_checkpoint
from specdec.audit import chi_square
from specdec.draft_tree import check_parents, node_depths, sibling_ranks
from specdec.drafters import DraftBatch, DrafterSetup, TargetFeatures
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.registry import build_drafter
from specdec.engine.llm import LLM
from specdec.models import AttentionMetadata, load_model
from specdec.rng import Stream, tree_draft_stream
from specdec.sampling import SampleOutput, SamplingParams, SamplingTensors, process_logits
from specdec.sampling import sampler as sampler_module

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB = 97
TOKENS = prompt_tokens(VOCAB, [20, 20, 20], seed=21)
ANCHORS = [4, 9, 17]
NUM_HEADS = 3
TEMPERATURE = 0.9
TREE = {"nodes": 7, "depth": 3, "topk": 2}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("medusa")
    config = medusa_config(NUM_HEADS, 1, "legacy")
    return write_checkpoint(path, config, medusa_tensors(NUM_HEADS, 1, "legacy"))


def tree_proposal(target_dir, head_dir, tree=TREE, greedy=False, temperatures=None):
    """The Medusa drafter with `tree` (built through the registry), fed the target's features
    of positions 0 .. A - 2, proposes for TOKENS at ANCHORS (methods standard, coupled,
    standard). Returns (drafter, batch, proposal, [B, D] each request's normed hidden state)."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(
        method="medusa",
        model=str(head_dir),
        draft_sample_method="greedy" if greedy else "probabilistic",
        tree=tree,
    )
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    assert isinstance(drafter, MedusaDrafter)
    ids = [f"r{i}" for i in range(len(TOKENS))]
    last = []
    for request_id, tokens, anchor in zip(ids, TOKENS, ANCHORS, strict=True):
        fed = tokens[: anchor - 1]
        kv = target.allocate_kv_cache(-(-len(fed) // 4), 4)
        attn = AttentionMetadata.build([len(fed)], [len(fed)], [list(range(kv.num_blocks))], 4)
        with torch.inference_mode():
            _, layers = target.forward_with_layers(
                torch.tensor(fed), torch.arange(len(fed)), attn, kv, drafter.feature_layers
            )
        drafter.observe(TargetFeatures([request_id], [0], [layers[0]]))
        last.append(layers[0][-1])
    temperatures = torch.tensor(temperatures or [TEMPERATURE] * 3)
    params = SamplingTensors.build(3, torch.device("cpu"), temperatures)
    batch = DraftBatch(
        token_ids=[t[:a] for t, a in zip(TOKENS, ANCHORS, strict=True)],
        seeds=torch.tensor([3, 4, 5]),
        anchors=torch.tensor(ANCHORS),
        num_draft=torch.tensor([tree["nodes"]] * 3),
        methods=["standard", "coupled", "standard"],
        params=params,
        request_ids=ids,
    )
    proposal = drafter.propose(batch)
    with torch.inference_mode():
        hidden = drafter.final_norm(torch.stack(last))
    return drafter, batch, proposal, hidden


def children_of(proposal, b):
    """{parent: [children in node order]} of request b's tree."""
    n = int(proposal.num_draft[b])
    kids: dict[int, list[int]] = {}
    for node in range(n):
        kids.setdefault(int(proposal.tree_parents[b, node]), []).append(node)
    return kids


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


def test_sampled_tree_nodes_are_their_heads_draws(target_dir, head_dir, noise_calls):
    """Node n at depth d: its token was drawn from head d's processed distribution without
    its earlier siblings' tokens, which is exactly the recorded draft distribution; keyed per
    node; the root and the depth-0 nodes have two children (a tree, not a chain)."""
    drafter, batch, proposal, hidden = tree_proposal(target_dir, head_dir)
    parents = proposal.tree_parents
    assert parents is not None and proposal.num_draft.tolist() == [7, 7, 7]
    check_parents(parents, proposal.num_draft)
    depths, ranks = node_depths(parents), sibling_ranks(parents, proposal.num_draft)
    with torch.inference_mode():
        heads = [drafter.heads(hidden, d) for d in range(NUM_HEADS)]  # [B, V] each
    expected_calls = []
    for b in range(3):
        kids = children_of(proposal, b)
        assert len(kids[-1]) == 2 and max(len(k) for k in kids.values()) == 2
        assert sorted(int(depths[b, n]) for n in range(7)) == [0, 0, 1, 1, 1, 1, 2]
        seed, anchor = int(batch.seeds[b]), ANCHORS[b]
        for node in range(7):
            depth, rank = int(depths[b, node]), int(ranks[b, node])
            siblings = kids[int(parents[b, node])]
            earlier = proposal.draft_token_ids[b, siblings[:rank]]
            want = heads[depth][b].clone()
            want[earlier] = float("-inf")
            want = process_logits(want[None], torch.tensor([TEMPERATURE]))[0]
            torch.testing.assert_close(proposal.draft_logits[b, node], want)
            token = int(proposal.draft_token_ids[b, node])
            assert torch.isfinite(want[token])
            if batch.methods[b] == "coupled" and rank == 0:
                expected_calls.append((seed, anchor + depth, int(Stream.TARGET), 0))
            else:
                word = int(tree_draft_stream(torch.tensor([node]))[0])
                expected_calls.append((seed, anchor + depth, word, anchor))
        for siblings in kids.values():
            tokens = proposal.draft_token_ids[b, siblings].tolist()
            assert len(set(tokens)) == len(tokens)
    assert sorted(noise_calls) == sorted(expected_calls)


def test_greedy_tree_takes_each_heads_top_tokens(target_dir, head_dir, noise_calls):
    """A greedy drafter's children of a depth-(d - 1) node are head d's top tokens in order
    (Medusa's top-k candidates), one-hot (no draft logits), no noise; sampled and greedy
    (temperature 0, best-first) requests alike."""
    drafter, _, proposal, hidden = tree_proposal(
        target_dir, head_dir, greedy=True, temperatures=[TEMPERATURE, 0.0, TEMPERATURE]
    )
    assert proposal.draft_logits is None and noise_calls == []
    depths = node_depths(proposal.tree_parents)
    with torch.inference_mode():
        heads = [drafter.heads(hidden, d) for d in range(NUM_HEADS)]
    for b in range(3):
        kids = children_of(proposal, b)
        assert max(len(k) for k in kids.values()) >= 2
        for siblings in kids.values():
            depth = int(depths[b, siblings[0]])
            top = heads[depth][b].topk(len(siblings)).indices.tolist()
            assert proposal.draft_token_ids[b, siblings].tolist() == top


@pytest.mark.parametrize("temperature", [TEMPERATURE, 0.0], ids=["sampled", "best-first"])
def test_trees_are_no_deeper_than_the_heads(target_dir, head_dir, temperature):
    """A tree asked for 6 levels over 3 heads: sampled trees grow level by level to the last
    head's depth (2 + 4 + 4 nodes); greedy ones best-first, within it (these flat random heads
    make them wide: every depth-1 candidate beats a depth-2 one)."""
    tree = {"nodes": 16, "depth": 6, "topk": 2}
    _, _, proposal, _ = tree_proposal(target_dir, head_dir, tree, temperatures=[temperature] * 3)
    check_parents(proposal.tree_parents, proposal.num_draft)
    depths = node_depths(proposal.tree_parents)
    for b in range(3):
        n = int(proposal.num_draft[b])
        if temperature > 0:
            assert n == 10 and int(depths[b, :n].max()) == NUM_HEADS - 1
        else:
            assert n == 16 and int(depths[b, :n].max()) <= NUM_HEADS - 1


def test_static_choice_lists_are_refused_by_name():
    choices = [[0], [0, 0], [1], [0, 1]]
    with pytest.raises(ValueError, match="medusa_choices"):
        SpeculativeConfig(method="medusa", model="x", tree=choices)


# --- Through the engine -----------------------------------------------------------------------

COMMON = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 64}
ENGINE_TREE = {"nodes": 6, "depth": 3, "topk": 2}


def _spec(head_dir, **extra):
    return {"method": "medusa", "model": str(head_dir), "tree": ENGINE_TREE, **extra}


def spied_llm(target_dir, spec):
    """An LLM whose drafter records the most children any node of each proposal has."""
    llm = LLM(str(target_dir), speculative_config=spec, **COMMON)
    drafter = llm.engine.drafter
    real, widths = drafter.propose, []

    def propose(batch):
        proposal = real(batch)
        assert proposal.tree_parents is not None
        for b in range(batch.batch_size):
            kids = children_of(proposal, b)
            widths.append(max((len(k) for k in kids.values()), default=0))
        return proposal

    drafter.propose = propose
    return llm, widths


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_greedy_trees_equal_greedy_plain(target_dir, head_dir, draft_sample_method):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target_dir), **COMMON).generate(prompts, params, use_tqdm=False)
    spec = _spec(head_dir, draft_sample_method=draft_sample_method)
    llm, widths = spied_llm(target_dir, spec)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_drafts"] > 0 and max(widths) >= 2


@pytest.mark.parametrize("method", ["coupled", "standard"])
def test_sampled_trees_run_and_coupled_equals_plain_sampling(target_dir, head_dir, method):
    """With the default verifier (coupled) the tokens are plain sampling's for the same seeds;
    standard trees run (exact in law: the law test below)."""
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    plain = LLM(str(target_dir), **COMMON).generate(prompts, params, use_tqdm=False)
    extra = {} if method == "coupled" else {"rejection_sample_method": method}
    llm, widths = spied_llm(target_dir, _spec(head_dir, **extra))
    assert llm.engine.speculative_config.rejection_sample_method == method
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in drafted)
    assert llm.get_metrics()["num_draft_tokens"] > 0 and max(widths) >= 2
    if method == "coupled":
        assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]


# --- The engine's law through Medusa trees (the vocabulary-8 target of the law tests) ---------

LAW_TOKENS, LAW_TRIALS, LOG10_ALPHA = 3, 12_000, -6
LAW_MAX_TOKENS = 6  # two rounds or more, each with a budget for a tree (2 root children)


@pytest.fixture(scope="module")
def law_dirs(tmp_path_factory):
    """The law tests' 3-layer vocabulary-8 Llama (hidden 32) and three one-block Medusa heads
    over it (FasterDecoding's names): random blocks, each head's projection the target's
    lm_head (as Medusa initialises its heads), so tree rounds accept about one token and
    reject as often."""
    import transformers

    target = save_vocab8_target(tmp_path_factory.mktemp("vocab8"))
    lm_head = transformers.LlamaForCausalLM.from_pretrained(target).lm_head.weight.detach()
    shapes = {}
    for i in range(NUM_HEADS):
        shapes[f"{i}.0.linear.weight"] = (32, 32)
        shapes[f"{i}.0.linear.bias"] = (32,)
    tensors = random_tensors(shapes, seed=6)
    tensors |= {f"{i}.1.weight": lm_head.clone() for i in range(NUM_HEADS)}
    config = medusa_config(NUM_HEADS, 1, "legacy")
    heads = write_checkpoint(tmp_path_factory.mktemp("medusa-vocab8"), config, tensors)
    return target, heads


def law_counts(law_dirs, method, temperature, draft_sample_method="probabilistic", tree=True):
    """Counts of the first 3 tokens through the engine: Medusa trees, or (tree False) chains of
    one draft per head with K pinned."""
    target, heads = law_dirs
    spec = _spec(heads, rejection_sample_method=method, draft_sample_method=draft_sample_method)
    if not tree:
        spec |= {"tree": None, "num_speculative_tokens": NUM_HEADS, "adaptive": False}
    counts, metrics = first_token_counts(
        target, spec, temperature, LAW_MAX_TOKENS, LAW_TOKENS, LAW_TRIALS
    )
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]
    return counts


@pytest.mark.stats
@pytest.mark.parametrize(
    ("method", "draft_sample_method", "tree"),
    [
        pytest.param("standard", "probabilistic", True, marks=pytest.mark.slow),
        ("coupled", "probabilistic", True),
        ("standard", "greedy", True),  # each head's top tokens: one-hot candidates
        pytest.param("standard", "probabilistic", False, marks=pytest.mark.slow),  # chains
    ],
    ids=["standard", "coupled", "standard-top-k", "standard-chain"],
)
def test_first_tokens_follow_the_target(law_dirs, method, draft_sample_method, tree):
    """H0: with Medusa trees (6 nodes, depth 3, top-2; sampled drafts, or each head's top
    tokens as deterministic candidates) or chains, the engine's first 3 emitted tokens (of 6)
    have the target's exact joint law. Statistic: Pearson chi-square over the 512 cells (cells
    expecting < 5 pooled), N = 12,000 seeded requests at temperature 0.7; reject at p < 1e-6,
    so the false-failure rate is <= 1e-6 per case (4 cases; sampled standard trees and chains
    run with the slow tests)."""
    law = exact_continuation_law(law_dirs[0], 0.7, LAW_TOKENS)
    counts = law_counts(law_dirs, method, 0.7, draft_sample_method, tree)
    result = chi_square(counts, law)
    assert result.log10_p > LOG10_ALPHA, result.describe()


@pytest.mark.stats
def test_negative_control_verifier_given_the_raw_head_distribution(law_dirs, monkeypatch):
    """The same test has power: it rejects (p < 1e-6) an engine whose tree verifier gets each
    head's raw logits instead of the processed distribution (temperature, earlier siblings
    excluded) its nodes were drawn from (temperature 1.6, standard verification)."""
    from specdec.drafters.base import Drafter

    real = Drafter.sample_draft

    def wrong_distribution(self, logits, rows, positions, batch, **tree_keys):
        out = real(self, logits, rows, positions, batch, **tree_keys)
        raw = self.to_target_vocab(logits)
        return SampleOutput(out.token_ids, raw, raw.logsumexp(dim=-1))

    monkeypatch.setattr(Drafter, "sample_draft", wrong_distribution)
    law = exact_continuation_law(law_dirs[0], 1.6, LAW_TOKENS)
    result = chi_square(law_counts(law_dirs, "standard", 1.6), law)
    assert result.log10_p < LOG10_ALPHA, result.describe()
