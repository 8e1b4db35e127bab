"""Filling a freshly built (empty) model with checkpoint tensors, with named, checked errors.

Shared by the safetensors and GGUF loaders; it never reads files itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: an unreadable file, a missing tensor, a wrong shape."""


def assign_weights(
    model: nn.Module,
    read_tensor: Callable[[str], torch.Tensor | None],
    source: str,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_dtype: Collection[str] = (),
) -> None:
    """Replaces every parameter of `model` by the checkpoint tensor of the same (HF) name.

    Args:
        model: a model whose parameters may be empty or on the meta device.
        read_tensor: returns the tensor stored under a parameter name, or None if absent.
        source: the checkpoint path, for error messages.
        dtype: dtype of the loaded parameters.
        device: device of the loaded parameters.
        keep_dtype: parameters that keep the checkpoint tensor's dtype (on the CPU, the tensor
            `read_tensor` returned: no copy), for a caller that quantizes them next, one at a
            time (`eagle.head.load_eagle_head`).

    Raises:
        CheckpointError: a missing tensor or a shape mismatch (the tensor is named).

    Mutates: `model`'s parameters (assigned, not copied into).
    """
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = read_tensor(name)
        if tensor is None:
            raise CheckpointError(
                f"{source}: missing tensor {name!r} (expected shape {list(param.shape)})"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"expected {list(param.shape)}"
            )
        state[name] = tensor.to(device=device, dtype=None if name in keep_dtype else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # buffers (RoPE frequencies) follow the parameters
    model.requires_grad_(False)
    model.eval()
