"""Tree drafts in the engine (EAGLE head, CPU synchronous path): greedy trees emit greedy plain
decoding, coupled trees emit plain sampling token for token, seeded standard trees replay, and
unsupported combinations are refused by name."""

from __future__ import annotations

import pytest

from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.drafters.config import SpeculativeConfig
from specdec.engine.llm import LLM
from specdec.sampling import SamplingParams

VOCAB = 97
COMMON = {"max_model_len": 96, "block_size": 4, "max_num_batched_tokens": 64}
TREE = {"nodes": 8, "depth": 4, "topk": 2}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return trained_head(target_dir, tmp_path_factory.mktemp("eagle"))


def tree_llm(target_dir, head_dir, method="standard", draft="probabilistic", tree=TREE):
    spec = {
        "method": "eagle",
        "model": str(head_dir),
        "rejection_sample_method": method,
        "draft_sample_method": draft,
        "tree": tree,
    }
    return LLM(str(target_dir), speculative_config=spec, **COMMON)


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


def test_trees_refuse_device_rounds_penalties_and_overrides(target_dir, head_dir):
    spec = {"method": "eagle", "model": str(head_dir), "tree": TREE}
    with pytest.raises(ValueError, match="synchronous engine path"):
        LLM(str(target_dir), speculative_config=spec, async_scheduling=True, **COMMON)
    llm = tree_llm(target_dir, head_dir)
    engine = llm.engine if hasattr(llm, "engine") else llm.llm_engine
    with pytest.raises(ValueError, match="penalties"):
        engine.add_request([1, 2, 3], SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="num_speculative_tokens cannot be overridden"):
        engine.add_request([1, 2, 3], speculative={"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="chain-only"):
        engine.add_request([1, 2, 3], speculative={"rejection_sample_method": "block"})
