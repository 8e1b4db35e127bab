"""Every drafter kind over the targets beyond Llama (issue 37): on tiny checkpoints written by
`transformers` (Gemma 2, Gemma 3, OLMo 2, Phi-3, Qwen3-MoE, Mixtral), an EAGLE head distilled
briefly on the target's features and a draft model (the target's own checkpoint) speculate, and
greedy speculation emits plain greedy's tokens with drafts proposed (and, for the draft model,
accepted). Block drafters (DFlash, DSpark) build their layers as the target's (its norm
placement and numerics, Gemma 2's soft-capped scores; a dense MLP over the mixture-of-experts
targets, started as the mean of the first experts): one copying all of a target's layers gives
its logits, and their greedy speculation emits plain greedy's tokens over every family; n-gram
drafting is checked in each family's own test file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from block_drafter_fixtures import save_tiny_block_drafter
from eagle_fixtures import trained_head
from models_fixtures import (
    NGRAM_PROMPTS,
    make_family_hf_model,
    make_gemma2_hf_model,
    make_gemma3_hf_model,
    make_hf_model,
    make_moe_hf_model,
    prompt_tokens,
    save_hf_model,
    speculative_equals_plain,
)
from specdec.drafters.block.network import BlockDrafterConfig, init_from_target
from specdec.engine.llm import LLM
from specdec.models import load_model, prompt_logits

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
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gemma2", "gemma3", "olmo2", "phi3"])
def test_block_drafters_equal_plain_greedy(name, kind, tmp_path):
    """A block drafter started from the target's last layers (its norm placement and numerics;
    over a MoE target the dense MLP is the mean of the first experts) and perturbed: its greedy
    speculation emits plain greedy's tokens, with drafts proposed (on these tiny random models
    acceptance is near chance: the layers' math is checked by the copying test below)."""
    path = save_hf_model(FAMILIES[name](), tmp_path / name)
    target = load_model(path).model
    drafter = save_tiny_block_drafter(tmp_path / kind, kind, target, block_size=3, noise=0.05)
    spec = {"method": kind, "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(path), speculative_config=spec, **COMMON)
    speculative_equals_plain(llm, NGRAM_PROMPTS)


# Families whose block-drafter layers must compute the target's own layers: Gemma 2 (soft-capped
# attention scores and final logits) with its window made longer than the prompt, Gemma 3 with its
# sliding layers' RoPE base and window made the global ones (a drafter layer attends its whole
# context with the global base), Phi-3 with LongRoPE and partial rotary (prompts within its
# original context).
LAYER_COPIES = {
    "gemma2": lambda: make_gemma2_hf_model("gemma2", sliding_window=256),
    "gemma3": lambda: make_gemma3_hf_model(
        "gemma3", sliding_window=256, rope_local_base_freq=1_000_000.0
    ),
    "olmo2": lambda: make_family_hf_model("olmo2"),
    "phi3_longrope": lambda: make_family_hf_model("phi3_longrope"),
    "qwen3": lambda: make_hf_model("qwen3_qk_norm"),
}


@pytest.mark.parametrize("name", list(LAYER_COPIES))
def test_a_block_drafter_copying_every_layer_computes_the_targets_logits(name, tmp_path):
    """The drafter's layers are the target family's: one that copies all of a target's layers
    (`init_from_target`), run over a prompt's embeddings with a causal mask and no context,
    gives the target's prompt logits (float32, within 1e-4). Control: the first layer's
    attention scale off by 1.5x moves the logits by more than 1e-2."""
    target = load_model(save_hf_model(LAYER_COPIES[name](), tmp_path / name)).model
    config = target.config
    drafter_config = BlockDrafterConfig(
        kind="dflash",
        feature_layers=(0,),
        target_hidden_size=config.hidden_size,
        target_vocab_size=config.vocab_size,
        target_num_hidden_layers=config.num_hidden_layers,
        num_hidden_layers=config.num_hidden_layers,
    )
    drafter = init_from_target(drafter_config, target)
    prompt = prompt_tokens(config.vocab_size, [20], seed=3)[0]
    want = prompt_logits(target, [prompt])[0]
    ids = torch.tensor(prompt)
    num = len(prompt)
    shape = (1, 0, config.num_key_value_heads, config.head_dim)
    context = [(torch.zeros(shape), torch.zeros(shape)) for _ in drafter.layers]
    mask = torch.ones(num, num, dtype=torch.bool).tril()[None]  # [1, R, 0 + R]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            hidden = drafter(target.model.embed(ids)[None], torch.arange(num)[None], context, mask)
            return target.compute_logits(hidden[0]).float()

    torch.testing.assert_close(logits(), want.float(), atol=1e-4, rtol=1e-4)
    drafter.layers[0].self_attn.scale *= 1.5
    assert (logits() - want.float()).abs().max() > 1e-2
