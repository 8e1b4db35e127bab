"""Drafter training (`specdec train-drafter`): target-annotated data, one pluggable `DrafterKind`
per drafter (registered by name), the training loop with checkpoints and resume, and the held-out
acceptance evaluation. Randomness only through `specdec.train.init` (keyed Philox streams)."""

from specdec.train.kind import (
    DrafterKind,
    TrainBatch,
    TrainOptions,
    get_kind,
    kind_names,
    register_kind,
    target_logits,
)

__all__ = [
    "DrafterKind",
    "TrainBatch",
    "TrainOptions",
    "get_kind",
    "kind_names",
    "register_kind",
    "target_logits",
]
