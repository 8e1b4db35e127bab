"""Tree drafts in the engine (CPU synchronous path; an EAGLE head, and a draft model: a second
random model, or the target itself as its own draft, whose first-child path greedy verification
accepts in full): greedy trees emit greedy plain decoding, coupled trees emit plain sampling
token for token, seeded standard trees replay, with or without logits rules (penalties, a
bias, allowed tokens, min_tokens) on the requests, and unsupported combinations are refused by
name."""

from __future__ import annotations

import pytest

from eagle_fixtures import tiny_target_and_head_fixtures
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.drafters.config import SpeculativeConfig
from specdec.engine.llm import LLM
from specdec.engine.spec_policy import SpeculationPolicy
from specdec.sampling import SamplingParams

VOCAB = 97
# Trees run on the synchronous path: asynchronous scheduling off (its "auto" is on on CUDA).
COMMON = {
    "max_model_len": 96,
    "block_size": 4,
    "max_num_batched_tokens": 64,
    "async_scheduling": False,
}
TREE = {"nodes": 8, "depth": 4, "topk": 2}

target_dir, head_dir = tiny_target_and_head_fixtures()


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another random model of the target's shape and vocabulary (a draft model)."""
    return save_hf_model(make_hf_model("llama", seed=5), tmp_path_factory.mktemp("other"))


def tree_llm(
    target_dir,
    head_dir,
    method="standard",
    draft="probabilistic",
    tree=TREE,
    kind="eagle",
    adaptive=False,
):
    """An engine of tree rounds; the policy's choice between a tree and no drafts pinned to
    the tree unless `adaptive` (these tests are about the tree rounds)."""
    spec = {
        "method": "eagle" if kind == "eagle" else "draft_model",
        "model": str(head_dir),
        "rejection_sample_method": method,
        "draft_sample_method": draft,
        "tree": tree,
        "adaptive": adaptive,
    }
    return LLM(str(target_dir), speculative_config=spec, **COMMON)


def draft_model_llm(target_dir, draft_dir, method="standard", draft="probabilistic", tree=TREE):
    return tree_llm(target_dir, draft_dir, method, draft, tree, kind="draft_model")


def outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "method, draft", [("standard", "greedy"), ("standard", "probabilistic"), ("coupled", "greedy")]
)
def test_greedy_tree_equals_greedy_plain(target_dir, head_dir, method, draft):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    llm = tree_llm(target_dir, head_dir, method, draft)
    assert outputs(llm, prompts, params) == plain
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=9, ignore_eos=True),
], ids=["t1", "top_k", "top_p"])  # fmt: skip
def test_coupled_tree_equals_plain_sampling(target_dir, head_dir, params):
    prompts = prompt_tokens(VOCAB, [6, 11], seed=4)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    llm = tree_llm(target_dir, head_dir, "coupled")
    assert outputs(llm, prompts, params) == plain
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("budget", [1, 3])
def test_a_requests_own_node_budget(target_dir, head_dir, budget):
    """A request's num_speculative_tokens is its tree's node budget a round (at most
    tree.nodes): its rounds draft no more nodes; a coupled tree still emits plain sampling."""
    prompts = prompt_tokens(VOCAB, [6, 11], seed=17)
    params = SamplingParams(temperature=0.9, max_tokens=16, seed=18, ignore_eos=True)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    llm = tree_llm(target_dir, head_dir, "coupled")
    own = {"num_speculative_tokens": budget}
    results = llm.generate(prompts, params, use_tqdm=False, speculative=own)
    assert [o.outputs[0].token_ids for o in results] == plain
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0
    assert metrics["num_draft_tokens"] <= budget * metrics["num_drafts"]
    assert metrics["num_draft_tokens"] > (budget - 1) * metrics["num_drafts"]


class ScriptedTreePolicy(SpeculationPolicy):
    """The tree arm policy (K = 0 or the tree's depth) whose n-th choice is script(n)."""

    def __init__(self, depth, script):
        super().__init__(depth, tree=True, side_budget=0.005)
        self.script = script

    def _choose(self, bucket, remaining=None, in_rounds=True, *_rest):
        return self.script(self._rounds)


def test_the_policy_chooses_between_a_tree_and_no_drafts(target_dir, head_dir):
    """With the adaptive policy (the default) a tree engine's synchronous steps take one of two
    arms: no drafts, or the whole tree (K = its depth). Steps scripted in turn: the K = 0 steps
    draft nothing, the others draft trees, and a coupled request emits plain sampling either
    way."""
    prompts = prompt_tokens(VOCAB, [6, 11], seed=21)
    params = SamplingParams(temperature=0.9, max_tokens=24, seed=22, ignore_eos=True)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    llm = tree_llm(target_dir, head_dir, "coupled", adaptive=True)
    assert llm.engine.policy.arms == [0, TREE["depth"]]
    llm.engine.policy = ScriptedTreePolicy(TREE["depth"], lambda n: (0, TREE["depth"])[n % 2])
    assert outputs(llm, prompts, params) == plain
    chosen = llm.get_metrics()["loop"]["k_chosen"]
    assert set(chosen) == {0, TREE["depth"]}
    metrics = llm.get_metrics()
    # a tree per request in the steps of the tree arm, none in the others
    assert 0 < metrics["num_drafts"] <= len(prompts) * chosen[TREE["depth"]]


def test_seeded_standard_tree_replays(target_dir, head_dir):
    prompts = prompt_tokens(VOCAB, [6, 11], seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=11, ignore_eos=True)
    first = outputs(tree_llm(target_dir, head_dir), prompts, params)
    llm = tree_llm(target_dir, head_dir)
    assert outputs(llm, prompts, params) == first
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_a_chain_shaped_tree_is_the_chain(target_dir, head_dir):
    """topk 1: every node has one child, so the tree is a chain of `depth` drafts; coupled
    output equals plain sampling and the accepted lengths behave like the chain's."""
    prompts = prompt_tokens(VOCAB, [7], seed=6)
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=3, ignore_eos=True)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    tree = {"nodes": 3, "depth": 3, "topk": 1}
    assert outputs(tree_llm(target_dir, head_dir, "coupled", tree=tree), prompts, params) == plain


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "ngram", "tree": TREE}, "tree is implemented for the methods"),
        (
            {"method": "eagle", "rejection_sample_method": "block", "tree": TREE},
            "block verification is chain-only",
        ),
        ({"method": "eagle", "tree": {"nodes": 4, "depth": 5, "topk": 2}}, "cannot exceed"),
        ({"method": "eagle", "tree": {"nodes": 4, "depth": 2}}, "missing"),
        ({"method": "eagle", "tree": {"nodes": 0, "depth": 1, "topk": 1}}, "nodes"),
    ],
)
def test_bad_tree_configs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)


def test_trees_refuse_device_rounds_block_and_budgets_past_their_nodes(target_dir, head_dir):
    spec = {"method": "eagle", "model": str(head_dir), "tree": TREE}
    with pytest.raises(ValueError, match="synchronous engine path"):
        LLM(str(target_dir), speculative_config=spec, **{**COMMON, "async_scheduling": True})
    llm = tree_llm(target_dir, head_dir)
    engine = llm.engine if hasattr(llm, "engine") else llm.llm_engine
    with pytest.raises(ValueError, match=r"node budget a round, at most tree\.nodes = 8, got 9"):
        engine.add_request([1, 2, 3], speculative={"num_speculative_tokens": 9})
    with pytest.raises(ValueError, match="chain-only"):
        engine.add_request([1, 2, 3], speculative={"rejection_sample_method": "block"})


# ------------------------------------------------------------------ logits rules on tree rounds
# Each node's target row is processed with the tokens of its path as output (`verify.tree_inputs.
# tree_context_target_logits`): a coupled tree then emits plain decoding's tokens under the same
# rules, a greedy one greedy plain decoding's.
RULES = {
    "repetition_penalty": 1.6,
    "presence_penalty": 0.8,
    "frequency_penalty": 0.5,
    "logit_bias": {3: 2.0, 7: -1.5},
    "allowed_token_ids": list(range(60)),
    "min_tokens": 6,
}
RULED = {
    "sampled": SamplingParams(temperature=0.9, max_tokens=16, seed=12, ignore_eos=True, **RULES),
    "greedy": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **RULES),
}


def ruled_llm(target_dir, head_dir, other_dir, kind, method):
    if kind == "eagle":
        return tree_llm(target_dir, head_dir, method)
    return draft_model_llm(target_dir, other_dir, method)


@pytest.mark.parametrize("kind", ["eagle", "draft_model"])
@pytest.mark.parametrize(
    "method, sampling", [("coupled", "sampled"), ("coupled", "greedy"), ("standard", "greedy")]
)
def test_trees_with_logits_rules_emit_plain_decoding_under_the_rules(
    target_dir, head_dir, other_dir, kind, method, sampling
):
    prompts = prompt_tokens(VOCAB, [6, 11, 4], seed=13)
    params = RULED[sampling]
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    assert (
        outputs(
            LLM(str(target_dir), **COMMON),
            prompts,
            SamplingParams(
                temperature=params.temperature, max_tokens=16, seed=params.seed, ignore_eos=True
            ),
        )
        != plain
    )  # the rules change what plain decoding emits
    llm = ruled_llm(target_dir, head_dir, other_dir, kind, method)
    assert outputs(llm, prompts, params) == plain
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0


def test_negative_control_tree_rows_blind_to_their_paths(
    target_dir, head_dir, other_dir, monkeypatch
):
    """The test above has power: a walk whose node rows are processed with the request's
    output alone (each node's path left out of its penalties and min_tokens) emits other tokens
    than plain decoding under the rules."""
    from specdec.engine import emitter
    from specdec.verify.tree_inputs import tree_context_target_logits

    def blind(target, draft_token_ids, parents, context):
        return tree_context_target_logits(target, [[]] * len(parents), [[]] * len(parents), context)

    monkeypatch.setattr(emitter, "tree_context_target_logits", blind)
    prompts = prompt_tokens(VOCAB, [6, 11, 4], seed=13)
    params = RULED["sampled"]
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    llm = ruled_llm(target_dir, head_dir, other_dir, "eagle", "coupled")
    assert outputs(llm, prompts, params) != plain


def test_coupled_trees_report_plain_decodings_logprobs(target_dir, head_dir):
    """Logprobs ride the tree rounds: each emitted token's entry is read from its own row (the
    root's or its accepted node's), and on the CPU a tree's rows are decode rows (each node over
    the keys before the tree and its path's), so a coupled tree reports plain decoding's tokens
    and logprobs bit for bit (under logits rules too)."""
    prompts = prompt_tokens(VOCAB, [6, 11], seed=15)
    params = SamplingParams(
        temperature=0.9, max_tokens=12, seed=16, ignore_eos=True, logprobs=3, **RULES
    )
    plain = LLM(str(target_dir), **COMMON).generate(prompts, params, use_tqdm=False)
    llm = tree_llm(target_dir, head_dir, "coupled")
    trees = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, trees, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert {t: e.logprob for t, e in x.items()} == {t: e.logprob for t, e in y.items()}
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_seeded_standard_trees_with_logits_rules_replay(target_dir, head_dir):
    prompts = prompt_tokens(VOCAB, [6, 11], seed=14)
    first = outputs(tree_llm(target_dir, head_dir), prompts, RULED["sampled"])
    llm = tree_llm(target_dir, head_dir)
    assert outputs(llm, prompts, RULED["sampled"]) == first
    assert llm.get_metrics()["num_accepted_tokens"] > 0


# ------------------------------------------------------------------ the draft model's trees
@pytest.mark.parametrize(
    "method, draft", [("standard", "greedy"), ("standard", "probabilistic"), ("coupled", "greedy")]
)
@pytest.mark.parametrize("draft_kind", ["self", "other"])
def test_draft_model_greedy_tree_equals_greedy_plain(
    target_dir, other_dir, method, draft, draft_kind
):
    """Both draft models' trees emit plain greedy decoding. The target as its own draft with
    greedy drafts: the root's first child is the target's greedy token and level 1 always
    expands it (the root has 2 children), so every round accepts its first draft and, but where
    the request's end leaves no room, its second."""
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    draft_dir = target_dir if draft_kind == "self" else other_dir
    llm = draft_model_llm(target_dir, draft_dir, method, draft)
    assert outputs(llm, prompts, params) == plain
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0
    if draft_kind == "self" and draft == "greedy":
        rounds, accepted = metrics["num_drafts"], metrics["accepted_per_position"]
        assert accepted[0] == rounds, metrics
        assert accepted[1] >= rounds - len(prompts), metrics


def test_draft_model_chain_shaped_tree_of_its_own_target_accepts_every_draft(target_dir):
    """topk 1, the target as its own greedy draft: a chain of 4 drafts, all accepted in every
    round with room for them (a control that the tree step's logits are the draft model's)."""
    prompts = prompt_tokens(VOCAB, [7, 12], seed=8)
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    tree = {"nodes": 4, "depth": 4, "topk": 1}
    llm = draft_model_llm(target_dir, target_dir, "standard", "greedy", tree=tree)
    assert outputs(llm, prompts, params) == plain
    metrics = llm.get_metrics()
    # 21 tokens: 1 from the prefill, then 4 rounds of 4 accepted drafts + 1 bonus token.
    assert metrics["num_drafts"] == 4 * len(prompts), metrics
    assert metrics["num_accepted_tokens"] == 16 * len(prompts), metrics


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=8, ignore_eos=True),
], ids=["t1", "top_k"])  # fmt: skip
@pytest.mark.parametrize("draft_kind", ["self", "other"])
def test_draft_model_coupled_tree_equals_plain_sampling(target_dir, other_dir, params, draft_kind):
    prompts = prompt_tokens(VOCAB, [6, 11], seed=4)
    plain = outputs(LLM(str(target_dir), **COMMON), prompts, params)
    draft_dir = target_dir if draft_kind == "self" else other_dir
    llm = draft_model_llm(target_dir, draft_dir, "coupled")
    assert outputs(llm, prompts, params) == plain
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0
    if draft_kind == "self":
        assert metrics["num_accepted_tokens"] > 0, metrics


def test_draft_model_seeded_standard_tree_replays(target_dir):
    prompts = prompt_tokens(VOCAB, [6, 11], seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=11, ignore_eos=True)
    first = outputs(draft_model_llm(target_dir, target_dir), prompts, params)
    llm = draft_model_llm(target_dir, target_dir)
    assert outputs(llm, prompts, params) == first
    assert llm.get_metrics()["num_accepted_tokens"] > 0
