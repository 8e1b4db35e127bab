"""Test helpers for the block drafters (dflash, dspark): tiny drafters with seeded random weights,
and target features computed outside the engine.

Random weights come from seeded generators here (tests only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.drafters import TargetFeatures
from specdec.drafters.block.checkpoint import save_block_drafter
from specdec.drafters.block.network import (
    BlockDrafterConfig,
    BlockDrafterModel,
    default_feature_layers,
    init_from_target,
)
from specdec.models import LlamaForCausalLM
from specdec.runner.model_runner import PagedModelRunner, StepInput


def tiny_block_drafter(
    kind: str,
    target: LlamaForCausalLM,
    *,
    block_size: int = 3,
    seed: int = 0,
    noise: float = 0.3,
    confidence_scale: float = 0.0,
    confidence_bias: float = 0.0,
    min_survival_probability: float = 0.0,
) -> BlockDrafterModel:
    """A drafter started from the target's weights (`init_from_target`) and perturbed with seeded
    noise of relative size `noise`, so that its drafts differ from the target's. DSpark: a random
    Markov head and a confidence head reading mostly W1[x_{i-1}] (weights of scale
    `confidence_scale`) with bias `confidence_bias`."""
    config = BlockDrafterConfig(
        kind=kind,
        feature_layers=default_feature_layers(target.config.num_hidden_layers),
        target_hidden_size=target.config.hidden_size,
        target_vocab_size=target.config.vocab_size,
        target_num_hidden_layers=target.config.num_hidden_layers,
        block_size=block_size,
        markov_rank=min(4, target.config.hidden_size) if kind == "dspark" else 0,
        min_survival_probability=min_survival_probability,
    )
    model = init_from_target(config, target)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("confidence"):
                scale = confidence_scale
            elif name.startswith("markov_out"):
                scale = 0.5
            else:
                scale = noise * float(param.abs().mean())
            param.add_(scale * torch.randn(param.shape, generator=generator))
        if model.confidence is not None:
            # Mostly driven by the previous draft (W1[x_{i-1}]), so admissions vary per chain.
            hidden = target.config.hidden_size
            model.confidence.weight[:, :hidden] *= 0.02
            model.confidence.bias.fill_(confidence_bias)
    return model.requires_grad_(False).eval()


def save_tiny_block_drafter(path: Path, *args, **kwargs) -> Path:
    return save_block_drafter(tiny_block_drafter(*args, **kwargs), path)


def target_features(
    target: LlamaForCausalLM, tokens: list[int], layers: tuple[int, ...]
) -> torch.Tensor:
    """[len(tokens), F] target features of a whole token list (one prefill on a scratch cache)."""
    block_size = 4
    num_blocks = -(-len(tokens) // block_size)
    runner = PagedModelRunner(target, num_blocks, block_size, max_num_seqs=1)
    _, features = runner.run_with_features(
        [StepInput(list(tokens), 0, list(range(num_blocks)), 1)], layers
    )
    return features[0]


def observe_context(drafter, request_ids: list[str], token_lists: list[list[int]]) -> None:
    """Hands the drafter the features of every token but the last of each list (what the engine
    has delivered when the last token is the round's input token)."""
    features = [
        target_features(drafter.target, tokens, drafter.feature_layers)[:-1]
        for tokens in token_lists
    ]
    drafter.observe(TargetFeatures(list(request_ids), [0] * len(request_ids), features))
