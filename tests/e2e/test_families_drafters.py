"""Every drafter kind over the targets beyond Llama (issue 37): on tiny checkpoints written by
`transformers` (Gemma 2, Gemma 3, OLMo 2, Phi-3, Qwen3-MoE, Mixtral), an EAGLE head distilled
briefly on the target's features and a draft model (the target's own checkpoint) speculate, and
greedy speculation emits plain greedy's tokens with drafts proposed (and, for the draft model,
accepted). Block drafters (DFlash, DSpark) build their layers as the target's: over the
mixture-of-experts targets (Llama's layers but for the sparse MLP) with a dense MLP started as the
mean of the first experts, and their greedy speculation emits plain greedy's tokens; over a
family whose layers are not Llama's they are refused by name
(`tests/unit/drafters/test_llama_layout_only.py`); n-gram drafting is checked in each family's
own test file."""

from __future__ import annotations

from pathlib import Path

import pytest

from block_drafter_fixtures import save_tiny_block_drafter
from eagle_fixtures import trained_head
from models_fixtures import (
    NGRAM_PROMPTS,
    make_family_hf_model,
    make_gemma2_hf_model,
    make_gemma3_hf_model,
    make_moe_hf_model,
    save_hf_model,
    speculative_equals_plain,
)
from specdec.engine.llm import LLM
from specdec.models import load_model

pytest.importorskip("transformers", reason="writes the tiny checkpoints")

FAMILIES = {
    "gemma2": lambda: make_gemma2_hf_model("gemma2"),
    "gemma3": lambda: make_gemma3_hf_model("gemma3"),
    "olmo2": lambda: make_family_hf_model("olmo2"),
    "phi3": lambda: make_family_hf_model("phi3"),
    "qwen3_moe": lambda: make_moe_hf_model("qwen3_moe"),
    "mixtral": lambda: make_moe_hf_model("mixtral"),
}
COMMON = {"max_model_len": 96, "block_size": 4, "max_num_seqs": 4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, save_hf_model(FAMILIES[name](), tmp_path_factory.mktemp(name))


@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_greedy_speculation_equals_plain_greedy(target, method, tmp_path):
    name, path = target
    if method == "eagle":
        spec = {"method": "eagle", "model": str(trained_head(path, tmp_path / "head"))}
    else:
        spec = {"method": "draft_model", "model": str(path)}
    spec |= {"num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(path), speculative_config=spec, **COMMON)
    outputs = speculative_equals_plain(llm, NGRAM_PROMPTS)
    if method == "draft_model":  # the target drafting for itself: every greedy draft accepted
        stats = [out.spec_decode_stats for out in outputs]
        assert sum(s["num_accepted_tokens"] for s in stats) == sum(
            s["num_draft_tokens"] for s in stats
        ), name


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_block_drafters_over_moe_targets_equal_plain_greedy(name, kind, tmp_path):
    """A block drafter started from a MoE target's last layers (attention and norms copied, the
    dense MLP the mean of the first experts) and perturbed: its greedy speculation emits plain
    greedy's tokens, with drafts proposed (DFlash's: some accepted)."""
    path = save_hf_model(FAMILIES[name](), tmp_path / name)
    target = load_model(path).model
    drafter = save_tiny_block_drafter(tmp_path / kind, kind, target, block_size=3, noise=0.05)
    spec = {"method": kind, "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(path), speculative_config=spec, **COMMON)
    outputs = speculative_equals_plain(llm, NGRAM_PROMPTS)
    accepted = sum(out.spec_decode_stats["num_accepted_tokens"] for out in outputs)
    # DSpark's fixture adds a random Markov head (`save_tiny_block_drafter`), whose drafts on
    # these tiny models may all be rejected; DFlash's are the copied layers' own.
    assert accepted > 0 or kind == "dspark", name
