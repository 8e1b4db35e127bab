"""The pluggable part of drafter training: the `DrafterKind` interface, one subclass per drafter
(eagle, draft_model, dflash, dspark; their table is `specdec.train.registry`). A kind builds and
initialises its network, computes its loss on a batch of target features, and saves/loads the
directory the engine loads with `speculative_config={"method": kind, "model": DIR}`. Kinds never
draw randomness themselves: `specdec.train.init` does.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdec.models import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class TrainOptions:
    """Settings of one training run (the `train-drafter` flags).

    Attributes:
        seed: the training seed (weight init and example order are keyed by it).
        max_steps: optimiser steps.
        batch_size: sequences per step.
        seq_len: tokens per training sequence (longer ones are cut).
        lr: peak learning rate (linear warm-up over `warmup_steps`, then cosine to 10%).
        warmup_steps: warm-up length.
        weight_decay: AdamW weight decay.
        grad_clip: max gradient norm.
        checkpoint_every: steps between checkpoints.
        extra: kind-specific settings (`--option key=value`), as strings.
    """

    seed: int = 0
    max_steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    extra: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default, kind=str):
        """A kind-specific option converted with `kind` (e.g. int), or `default`."""
        return kind(self.extra[key]) if key in self.extra else default


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """A batch of target-annotated sequences (right-padded).

    Attributes:
        token_ids: [B, T] int64 tokens (padding: 0).
        features: [B, T, F] float32 target features (the kind's `feature_layers` outputs
            concatenated) of each token.
        last_hidden: [B, T, D] float32 the target's last-layer output (before the final norm) of
            each token; `target_logits(target, last_hidden)` gives the target's next-token logits.
        loss_mask: [B, T] bool, True where the target's next-token distribution at t is a
            training label (a real token of the part being distilled, e.g. a response).
    """

    token_ids: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def target_logits(
    target: LlamaForCausalLM, last_hidden: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """[.., D] last-layer outputs -> [.., V] (or [.., len(rows)]) float32 target logits."""
    weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    if rows is not None:
        weight = weight.index_select(0, rows)
    return torch.nn.functional.linear(target.model.norm(last_hidden), weight).float()


class DrafterKind(abc.ABC):
    """How to train one kind of drafter. Subclasses set `name` and implement the methods."""

    name: str = ""
    option_names: frozenset[str] = frozenset()  # the `--option` keys this kind reads

    def check_options(self, options: TrainOptions) -> None:
        """Refuses `--option` keys this kind does not read, naming them."""
        unknown = sorted(set(options.extra) - self.option_names)
        if unknown:
            known = ", ".join(sorted(self.option_names)) or "none"
            raise ValueError(
                f"--option {', '.join(unknown)}: not an option of the {self.name} drafter "
                f"(its options: {known})"
            )

    def feature_layers(self, target: LlamaForCausalLM, options: TrainOptions) -> tuple[int, ...]:
        """Target layers whose outputs the batches must carry as `features` (default none)."""
        return ()

    def prepare(self, target: LlamaForCausalLM, token_counts: torch.Tensor, options) -> None:  # noqa: B027
        """Sees the training set's token frequencies before `build` ([V] int64; e.g. to pick a
        reduced draft vocabulary). Default: nothing."""

    @abc.abstractmethod
    def build(self, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        """A fresh, initialised draft network (float32, on the target's device, trainable)."""

    @abc.abstractmethod
    def loss(
        self, draft: nn.Module, target: LlamaForCausalLM, batch: TrainBatch, options: TrainOptions
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(scalar loss to minimise, figures to show, e.g. {"acc": top-1 agreement})."""

    @abc.abstractmethod
    def save(
        self, draft: nn.Module, target: LlamaForCausalLM, out_dir: Path, options: TrainOptions
    ) -> None:
        """Writes config.json + model.safetensors into `out_dir` (engine-loadable)."""

    @abc.abstractmethod
    def load(self, out_dir: Path, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        """Reads what `save` wrote back as a trainable float32 network (to resume training)."""
