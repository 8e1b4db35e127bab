"""The CPU decode step's decoder layers as one C++ call (`csrc/decode_layers.cpp`).

On the CPU a quantized model's decode step is bound by the work between its operations, not
by arithmetic (BENCHMARKS area 6: a few thousand small operations a token). The C++ loop runs
the very ATen operations of the Python loop (`LlamaModel._forward_decode` over
`LlamaDecoderLayer.forward_decode` with a `DecodePlanCPU`), in the same order on the same
views, so a step's logits, K/V and captured layers are the Python loop's bit for bit (tests
compare them): the Python loop is its twin, and the fallback wherever the C++ cannot run.

It runs models whose layers are all the plain Llama kind: RMSNorm before attention and MLP
(float32), fused q/k/v and gate/up products in PyTorch's CPU int4 layout with no bias, no q/k
norm, SiLU, no sliding window, soft-capping, local RoPE table, tensor parallelism or experts
(`native_reason` names what a model has instead).

The extension (`cpu_extension`: built once per machine) also holds `q8_linear`, the LM head's
product; without it, or with `SPECDEC_CPU_NATIVE=0`, the Python loop runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specdec.models.decode_cpu import DecodePlanCPU
from specdec.models.decoder_layers import LlamaDecoderLayer, LlamaMLP

if TYPE_CHECKING:
    from specdec.models.attention import KVCache


def native_reason(model: torch.nn.Module) -> str | None:
    """Why the C++ loop cannot run `model`'s layers (a `LlamaModel`), or None when it can."""
    if any(kind != (None, False) for kind in model.layer_kinds):
        return "sliding-window or local-RoPE layers"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer or not isinstance(layer.mlp, LlamaMLP):
            return "a layer other than Llama's (post-norm, experts)"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.tp is not None or mlp.tp is not None:
            return "tensor parallelism"
        if attn.q_norm is not None or attn.softcap is not None or mlp.gelu:
            return "q/k norms, soft-capping or a GeGLU MLP"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not norm.is_llama or norm.weight.dtype != torch.float32:
                return "a norm other than Llama's in float32"
            if norm.eps != model.layers[0].input_layernorm.eps:
                return "norms of different epsilons"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear is None or linear.bias is not None or linear.quantized is None:
                return "unfused, biased or float products"
            if linear.quantized.layout != "cpu_int4":
                return f"{linear.quantized.layout} weights"
    return None


def layer_operands(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """Per layer its two norm weights and four (packed, scale_zero) pairs; per layer and
    linear (group size, source group or 0): the C++ loop's `weights` and `meta`."""
    weights: list[torch.Tensor] = []
    meta: list[int] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            quantized = linear.quantized
            weights += [quantized._tensors["packed"], quantized._tensors["scale_zero"]]
            meta += [quantized._meta["group_size"], quantized._meta["source_group"] or 0]
    return weights, meta


def run_layers(
    extension: Any,
    operands: tuple[list[torch.Tensor], list[int]],
    model: torch.nn.Module,
    out: torch.Tensor,
    plan: DecodePlanCPU,
    kv_cache: KVCache,
    return_layers: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Every decoder layer of `model` over the embeddings `out` ([T, D]) as the Python loop
    runs them with `plan`: (out, residual, the residual stream after each of `return_layers`).

    Mutates: writes the step's K/V into `kv_cache`."""
    first_rows: list[int] = []
    counts: list[int] = []
    offsets = [0]
    key_starts: list[int] = []
    key_slots: list[torch.Tensor] = []
    empty = torch.empty(0, dtype=torch.int64)
    for first_row, row_counts, keys in plan.sequences:
        first_rows.append(first_row)
        counts += row_counts
        offsets.append(len(counts))
        if isinstance(keys, int):
            key_starts.append(keys)
            key_slots.append(empty)
        else:
            key_starts.append(-1)
            key_slots.append(keys)
    attn = model.layers[0].self_attn
    weights, meta = operands
    return extension.decode_layers(
        out,
        weights,
        meta,
        plan.cos,
        plan.sin,
        plan.half_swap,
        plan.slots,
        plan.write_rows,
        first_rows,
        counts,
        offsets,
        key_starts,
        key_slots,
        plan.all_live,
        kv_cache.k_cache,
        kv_cache.v_cache,
        attn.num_heads,
        attn.num_kv_heads,
        attn.scale,
        model.layers[0].input_layernorm.eps,
        return_layers,
    )
