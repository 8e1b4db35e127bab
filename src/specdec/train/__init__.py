"""Drafter training (`specdec train-drafter`): target-annotated data, one pluggable `DrafterKind`
per drafter (a table by name), the training loop with checkpoints and resume, and the held-out
acceptance evaluation. Randomness only through `specdec.train.init` (keyed Philox streams)."""

from specdec.train.kind import DrafterKind, TrainBatch, TrainOptions, target_logits
from specdec.train.registry import DRAFTER_KINDS, get_kind, kind_names

__all__ = [
    "DRAFTER_KINDS",
    "DrafterKind",
    "TrainBatch",
    "TrainOptions",
    "get_kind",
    "kind_names",
    "target_logits",
]
