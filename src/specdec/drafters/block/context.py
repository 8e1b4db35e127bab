"""A block drafter's per-request context: each drafter layer's keys/values of the positions seen
so far, in buffers grown geometrically (the host path's state; device rounds copy it in and out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True, eq=False)
class RequestContext:
    """One request's context keys/values per drafter layer, for positions 0..length-1."""

    length: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [capacity, H_kv, D_head]
    values: list[torch.Tensor] = field(default_factory=list)


def store_context(context: RequestContext, layer: int, start: int, keys, values) -> None:
    """Writes keys/values [n, H_kv, D_head] at positions start.. of one layer, growing its buffer
    geometrically so that a round costs O(new tokens)."""
    end = start + keys.shape[0]
    if layer == len(context.keys):
        context.keys.append(keys.new_zeros((max(end, 16), *keys.shape[1:])))
        context.values.append(values.new_zeros((max(end, 16), *values.shape[1:])))
    if end > context.keys[layer].shape[0]:
        capacity = max(end, 2 * context.keys[layer].shape[0])
        for buffers in (context.keys, context.values):
            grown = buffers[layer].new_zeros((capacity, *buffers[layer].shape[1:]))
            grown[:start] = buffers[layer][:start]
            buffers[layer] = grown
    context.keys[layer][start:end] = keys
    context.values[layer][start:end] = values
