"""Deterministic training randomness: weight initialisation and example order, drawn from keyed
Philox streams (`Stream.TRAIN_INIT`, `Stream.TRAIN_ORDER`) so a training run replays exactly
from its seed. Never uses torch's or Python's global generators."""

from __future__ import annotations

import torch
from torch import nn

from specdec.rng import Stream, to_signed64, uniform


def keyed_uniform(seed: int, index: int, stream: Stream, count: int) -> torch.Tensor:
    """[count] float32 uniforms in (0, 1) keyed by (seed, index, stream); lane = element."""
    seeds = torch.tensor([to_signed64(seed)], dtype=torch.int64)
    return uniform(seeds, torch.tensor([index], dtype=torch.int64), stream, count)[0]


@torch.no_grad()
def init_parameters_(module: nn.Module, seed: int, residual_scale: float = 1.0) -> None:
    """Fills every parameter of `module` (in `named_parameters` order) from keyed uniforms.

    Norm weights (1-d parameters named `*norm*`) become 1, biases 0; matrices [out, in] are
    uniform in +-1/sqrt(in) (the scale of PyTorch's default Linear init), multiplied by
    `residual_scale` for the projections that write into a residual stream (`o_proj`,
    `down_proj`), so a fresh block starts close to the identity.

    RNG: `Stream.TRAIN_INIT`, position = parameter index, one lane per element.
    Mutates: the parameters of `module`.
    """
    for index, (name, param) in enumerate(module.named_parameters()):
        if param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
            continue
        bound = param.shape[-1] ** -0.5
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            bound *= residual_scale
        values = keyed_uniform(seed, index, Stream.TRAIN_INIT, param.numel())
        param.copy_(((2.0 * values - 1.0) * bound).view(param.shape).to(param.dtype))


def permutation(seed: int, epoch: int, count: int) -> list[int]:
    """A permutation of range(count) for one epoch (argsort of keyed uniforms).

    RNG: `Stream.TRAIN_ORDER`, position = epoch, one lane per example.
    """
    if count == 0:
        return []
    return torch.argsort(keyed_uniform(seed, epoch, Stream.TRAIN_ORDER, count)).tolist()
