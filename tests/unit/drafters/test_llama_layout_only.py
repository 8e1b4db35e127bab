"""The draft-model trainer, which rebuilds a target's layers as Llama's, refuses targets whose
layers are not Llama's (OLMo 2's norms after attention and MLP, Phi-3's partial rotary, ...) by
name, instead of computing something else. Block drafters build their layers with the target's
norm placement and numerics; over the
mixture-of-experts targets their layers are dense, and an MLP copied from a sparse one computes
the mean of its first experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from specdec.drafters.block.network import (
    BlockDecoderLayer,
    BlockDrafterConfig,
    BlockDrafterModel,
    BlockPostNormLayer,
    BlockSandwichLayer,
    experts_as_dense,
    layer_config,
)
from specdec.models.config import ModelConfig
from specdec.models.decoder_layers import LlamaMLP
from specdec.models.families import check_llama_layout
from specdec.models.moe import SparseMoeBlock

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
def test_training_a_draft_model_over_another_layout_is_refused_by_name(architecture):
    target = dataclasses.replace(BASE, architecture=architecture)
    with pytest.raises(ValueError, match=f"training a draft model .* {architecture}"):
        check_llama_layout(target, "training a draft model")


@pytest.mark.parametrize(
    ("architecture", "placement", "layer"),
    [
        ("Olmo2ForCausalLM", "post", BlockPostNormLayer),
        ("Gemma3ForCausalLM", "sandwich", BlockSandwichLayer),
        ("Gemma2ForCausalLM", "sandwich", BlockSandwichLayer),
        ("Phi3ForCausalLM", "pre", BlockDecoderLayer),
    ],
)
def test_a_block_drafters_layers_take_the_targets_norm_placement(architecture, placement, layer):
    target = dataclasses.replace(BASE, architecture=architecture, norm_placement=placement)
    model = _block(target)
    assert all(type(block) is layer for block in model.layers)


def test_llama_layouts_build():
    """The control: the same construction over a Llama-layout target goes through."""
    for architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        _block(dataclasses.replace(BASE, architecture=architecture))


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_block_drafter_over_a_moe_target_has_dense_layers(architecture):
    """Over a MoE target the drafter's layers are Llama's with a dense MLP of the target's
    intermediate_size (no router, no experts); training a draft model is still refused."""
    target = dataclasses.replace(
        BASE,
        architecture=architecture,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_layers=(0, 1),
    )
    model = _block(target)
    assert not any(isinstance(module, SparseMoeBlock) for module in model.modules())
    assert all(isinstance(layer.mlp, LlamaMLP) for layer in model.layers)
    assert model.layers[0].mlp.down_proj.weight.shape == (32, 64)
    with pytest.raises(ValueError, match=f"training a draft model .* {architecture}"):
        check_llama_layout(target, "training a draft model")


def _expert_out(expert, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = expert.gate_proj.weight, expert.up_proj.weight, expert.down_proj.weight
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@pytest.mark.parametrize(("expert_width", "count"), [(16, 4), (24, 2), (64, 1), (96, 1)])
def test_experts_as_dense_computes_the_mean_of_the_first_experts(expert_width, count):
    """The dense MLP (width 64) started from a sparse block computes the mean of as many of its
    first experts as the width holds (an expert wider than the MLP: its first 64 rows); the
    control, the first expert alone, differs wherever more than one expert is averaged."""
    generator = torch.Generator().manual_seed(0)
    block = SparseMoeBlock(32, expert_width, 6, 2, True)
    for param in block.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.2
    mlp = LlamaMLP(layer_config(_config(), dataclasses.replace(BASE, intermediate_size=64)))
    mlp.load_state_dict(experts_as_dense(block, mlp))
    x = torch.randn(5, 32, generator=generator)
    experts = list(block.experts)[:count]
    if expert_width > 64:  # the first rows of expert 0 only
        weights = {name: getattr(experts[0], name).weight for name in ("gate_proj", "up_proj")}
        down = experts[0].down_proj.weight[:, :64]
        gate, up = weights["gate_proj"][:64], weights["up_proj"][:64]
        want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    else:
        want = torch.stack([_expert_out(expert, x) for expert in experts]).mean(dim=0)
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)
    if count > 1:
        assert (mlp(x) - _expert_out(experts[0], x)).abs().max() > 1e-2


def _config() -> BlockDrafterConfig:
    return BlockDrafterConfig(
        kind="dflash",
        feature_layers=(0, 1),
        target_hidden_size=BASE.hidden_size,
        target_vocab_size=BASE.vocab_size,
        target_num_hidden_layers=BASE.num_hidden_layers,
    )
