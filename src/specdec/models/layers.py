"""The building blocks of the model's layers: `Linear` (float or quantized weights; decode
products that never depend on the row count), `Embedding` (float or quantized table,
vocabulary-parallel under tensor parallelism), `RMSNorm`, and the fusing of projections that
read the same input. Parameters are created empty and only ever filled from checkpoint files;
nothing here reads files or samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.linear import batch_invariant_linear
from specdec.models.quant import QuantizedWeight, embedding_lookup, quant_linear
from specdec.models.quant_formats import GroupQuantized
from specdec.models.rms_norm import FLOAT32_WEIGHT, LLAMA, UNIT_OFFSET, rms_norm_values
from specdec.models.tensor_parallel import Collectives


class Linear(nn.Module):
    """`y = x W^T + b` with empty parameters (filled by the loader, never initialised here).

    A quantized linear has no `weight` parameter: `quantized` holds W in its kernel's layout
    (`models/quant.py`) and the product runs through `quant_linear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # [out]
        self.quantized: QuantizedWeight | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Replaces the float weight by `weight` ([out, in]). Mutates: drops `self.weight`."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight of shape {list(weight.shape)} for a linear of "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.register_parameter("weight", None)
        self.quantized = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ bias); a row's value never depends on how many rows x has (a quantized
        weight's kernel, `batch_invariant_linear` for a float one)."""
        if self.quantized is not None:
            return quant_linear(x, self.quantized, self.bias)
        return batch_invariant_linear(x, self.weight, self.bias)

    decode = forward  # the decode path's call (no module hooks); the same product


class Embedding(nn.Module):
    """Token embedding table with an empty [V, D] weight, or a quantized table whose rows are
    dequantized on lookup (GGUF embeddings stay quantized).

    Vocabulary-parallel when `first_id` is set: the table holds rows first_id..first_id+V-1;
    other ids look up zeros, and the ranks' lookups are summed (`tp`), one nonzero per row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, first_id: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))  # [V, D]
        self.quantized: GroupQuantized | None = None
        self.dtype: torch.dtype | None = None
        self.num_embeddings = num_embeddings
        self.first_id = first_id
        self.tp: Collectives | None = None

    def set_quantized(self, table: GroupQuantized, dtype: torch.dtype) -> None:
        """Replaces the float table by `table` ([V, D], on the model's device); lookups return
        `dtype`. Mutates: drops `self.weight`."""
        self.register_parameter("weight", None)
        self.quantized, self.dtype = table, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.first_id is None:
            return self._lookup(input_ids)
        local = input_ids - self.first_id  # [T]; no host sync: masked, never filtered
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = self._lookup(torch.where(inside, local, torch.zeros_like(local)))
        rows = torch.where(inside[:, None], rows, torch.zeros_like(rows))
        return rows if self.tp is None else self.tp.all_reduce(rows)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return embedding_lookup(self.quantized, input_ids).to(self.dtype)
        return F.embedding(input_ids, self.weight)


def fuse_linears(linears: Sequence[Linear]) -> Linear:
    """One Linear for linears that read the same input: their weights (and biases)
    concatenated into one [sum(out), in] tensor, each linear's parameters re-pointed at its
    slice (no copy kept). Quantized linears are fused by the loader instead
    (`fused_quantized`)."""
    if any(linear.quantized is not None for linear in linears):
        raise ValueError("quantized linears are fused from their source weights at load")
    weight = torch.cat([linear.weight.data for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = torch.cat([linear.bias.data for linear in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("cannot fuse linears of which only some have a bias")
    offset = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[offset : offset + rows]
        if bias is not None and linear.bias is not None:
            linear.bias.data = bias[offset : offset + rows]
        offset += rows
    with torch.device("meta"):
        fused = Linear(weight.shape[1], weight.shape[0], bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def set_fused(module: nn.Module, name: str, fused: Linear) -> None:
    """Sets `module.<name>` to a fused Linear without registering it as a submodule: its
    weights are views of the parts' (float) or stand for them (quantized), so the state dict
    keeps the checkpoint's names and nothing is counted twice."""
    object.__setattr__(module, name, fused)


def fused_quantized(
    linears: Sequence[Linear], weight: QuantizedWeight, bias: torch.Tensor | None
) -> Linear:
    """The fused Linear of `linears` from their concatenated quantized `weight` ([sum(out), in])
    and bias ([sum(out)] or None); the parts give up their float weights (the fused one is the
    only copy). Mutates: `linears` (their `weight` parameters are dropped)."""
    if weight.shape[0] != sum(linear.out_features for linear in linears):
        raise ValueError(f"a fused weight of {weight.shape[0]} rows for {len(linears)} linears")
    with torch.device("meta"):
        fused = Linear(weight.shape[1], weight.shape[0], bias is not None)
    fused.set_quantized(weight)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    for linear in linears:
        linear.register_parameter("weight", None)
    return fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 as `transformers` does: cast back before the weight (Llama),
    or with `weight_in_float32` after it (OLMo 2); with `unit_offset` the scale is (1 + weight),
    in float32 before the cast (Gemma's zero-centred weights)."""

    def __init__(
        self, dim: int, eps: float, weight_in_float32: bool = False, unit_offset: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))  # [dim]
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.unit_offset = unit_offset

    @property
    def is_llama(self) -> bool:
        """Whether these are Llama's numerics (the CPU decode step's C++ loop has only them)."""
        return self.numerics == LLAMA

    @property
    def numerics(self) -> int:
        """Its `rms_norm` numerics code (the fused kernels take it)."""
        if self.unit_offset:
            return UNIT_OFFSET
        return FLOAT32_WEIGHT if self.weight_in_float32 else LLAMA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_values(x, self.weight, self.eps, self.numerics)
