"""An EAGLE head for the tiny test target, briefly distilled on its features (shared by the
drafter and engine tests)."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.models import load_model
from specdec.train.data import TrainingSet, annotate_token_lists
from specdec.train.kind import TrainOptions
from specdec.train.kinds.eagle import EagleKind

VOCAB = 97


def trained_head(target_dir, out, draft_vocab_size=0, steps=15):
    """An EAGLE head briefly distilled on the target's features of random token sequences."""
    target = load_model(target_dir).model
    kind = EagleKind()
    options = TrainOptions(
        seed=3, lr=3e-3, extra={"draft_vocab_size": str(draft_vocab_size), "ttt_steps": "2"}
    )
    layers = kind.feature_layers(target, options)
    data = TrainingSet(
        layers, annotate_token_lists(target, prompt_tokens(VOCAB, [24] * 16), layers)
    )
    kind.prepare(target, data.token_counts(VOCAB), options)
    draft = kind.build(target, options)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=options.lr)
    windows = data.chunks(24)
    for step in range(steps):
        batch = data.batch([windows[(step * 4 + i) % len(windows)] for i in range(4)], 24, layers)
        loss, _ = kind.loss(draft, target, batch, options)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    kind.save(draft, target, out, options)
    return out


def tiny_target_and_head_fixtures():
    """Two module-scoped pytest fixtures for a test module to bind at its top level,
    `target_dir, head_dir = tiny_target_and_head_fixtures()`: `target_dir`, the tiny Llama
    (`make_hf_model("llama")`) saved as an HF checkpoint, and `head_dir`, an EAGLE head
    `trained_head` distilled on it. Each module that binds them builds its own pair."""

    @pytest.fixture(scope="module")
    def target_dir(tmp_path_factory):
        return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))

    @pytest.fixture(scope="module")
    def head_dir(target_dir, tmp_path_factory):
        return trained_head(target_dir, tmp_path_factory.mktemp("eagle"))

    return target_dir, head_dir
