"""Code that rebuilds a target's layers as Llama's (block drafters' layers, the draft-model
trainer) refuses targets whose layers are not Llama's (OLMo 2's norms after attention and MLP,
Phi-3's partial rotary, ...) by name, instead of computing something else."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.drafters.block.network import BlockDrafterConfig, BlockDrafterModel
from specdec.models.config import ModelConfig
from specdec.models.families import check_llama_layout

BASE = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


def _block(target: ModelConfig) -> BlockDrafterModel:
    config = BlockDrafterConfig(
        kind="dflash",
        feature_layers=(0, 1),
        target_hidden_size=target.hidden_size,
        target_vocab_size=target.vocab_size,
        target_num_hidden_layers=target.num_hidden_layers,
    )
    return BlockDrafterModel(config, target)


@pytest.mark.parametrize("architecture", ["Olmo2ForCausalLM", "Phi3ForCausalLM"])
def test_a_block_drafter_over_another_layout_is_refused_by_name(architecture):
    target = dataclasses.replace(BASE, architecture=architecture)
    with pytest.raises(ValueError, match=f"the dflash drafter is not available for {architecture}"):
        _block(target)
    with pytest.raises(ValueError, match=f"training a draft model .* {architecture}"):
        check_llama_layout(target, "training a draft model")


def test_llama_layouts_build():
    """The control: the same construction over a Llama-layout target goes through."""
    for architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        _block(dataclasses.replace(BASE, architecture=architecture))
