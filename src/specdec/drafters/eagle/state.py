"""The EAGLE drafter's per-request state: its head cache's blocks and what it was fed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True, eq=False)
class EagleState:
    """One request's head cache: entries 0..num_fed-1 hold K/V computed from target features;
    `pending` holds delivered features not fed yet (positions num_fed .. feature_end-1)."""

    block_ids: list[int] = field(default_factory=list)
    num_fed: int = 0
    feature_end: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
