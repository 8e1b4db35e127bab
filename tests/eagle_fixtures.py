"""An EAGLE head for the tiny test target, briefly distilled on its features (shared by the
drafter and engine tests)."""

from __future__ import annotations

import torch

from models_fixtures import prompt_tokens
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
