"""The EAGLE head's CPU decode step as one C++ call (`models/csrc/head_step.cpp`).

At batch 1 on the CPU the head's step is bound by the work between its operations (some 70 of
them, a few microseconds each in the interpreter), not by its products. The C++ step runs the
very ATen operations of the Python path (`EagleHead.project_features` + `forward_decode` over
`DecodeMetadata`: `HeadGraphs.forward`, `EagleDrafter._decode_step`), in the same order on
the same views, so its head outputs and K/V are the Python path's bit for bit (tests compare
them): the Python path is its twin, and the fallback wherever the C++ cannot run (another
layout, a window, a tree, split-KV, float linears; no extension, or `SPECDEC_CPU_NATIVE=0`).
Never draws randomness and never scores the LM head (`head_logits` does, after it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.drafters.eagle.head import EagleHead, HeadLayout
from specdec.models.attention import DecodeMetadata, KVCache
from specdec.models.cpu_extension import load_extension
from specdec.models.decoder_layers import LlamaDecoderLayer, LlamaMLP

# (input [R, F] or [R, D], project, embeds [R, D], positions [R], meta, ends [S] or None)
# -> [R or S, D] head outputs; writes the entries' K/V.
HeadStep = Callable[..., torch.Tensor]


def native_reason(head: torch.nn.Module, kv_cache: KVCache) -> str | None:
    """Why the C++ step cannot run `head` over `kv_cache`, or None when it can."""
    if type(head) is not EagleHead or head.config.layout != HeadLayout():
        return "a head other than ours (a public layout or EAGLE-3)"
    if head.device.type != "cpu" or head.dtype != torch.float32:
        return "not a float32 head on the CPU"
    if kv_cache.k_cache.dtype != torch.float32 or kv_cache.v_cache.dtype != torch.float32:
        return "a KV cache other than float32"
    layer = head.layer
    if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
        return "a decoder layer other than Llama's"
    attn, mlp = layer.self_attn, layer.mlp
    if attn.tp is not None or mlp.tp is not None or attn.q_norm is not None or mlp.gelu:
        return "tensor parallelism, q/k norms or a GeGLU MLP"
    if attn.softcap is not None or attn.sliding_window is not None:
        return "soft-capping or a sliding window"
    norms = (head.embed_norm, head.hidden_norm, layer.input_layernorm)
    norms += (layer.post_attention_layernorm, head.feature_norm)
    if any(norm.weight.dtype != torch.float32 for norm in norms):
        return "norm weights other than float32"
    for linear in (head.fc, head.in_proj, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj):
        if linear is None or linear.bias is not None or linear.quantized is None:
            return "unfused, biased or float products"
        if linear.quantized.layout != "cpu_int8":
            return f"{linear.quantized.layout} weights"
    down = mlp.down_proj
    if down.bias is not None or down.quantized is None or down.quantized.layout != "cpu_int8":
        return "a float, biased or non-int8 down_proj"
    return None


def native_head_step(head: EagleHead, kv_cache: KVCache) -> HeadStep | None:
    """The C++ step for `head` over `kv_cache` (see `head_step`), or None where it cannot run
    (see `native_reason`) or the extension is not built here."""
    if native_reason(head, kv_cache) is not None or load_extension() is None:
        return None
    layer = head.layer
    attn, mlp = layer.self_attn, layer.mlp

    def int8(linear) -> list[torch.Tensor]:
        tensors = linear.quantized._tensors
        return [tensors["values"], tensors["scale"]]

    weights = [
        head.feature_norm.weight,
        *int8(head.fc),
        head.embed_norm.weight,
        head.hidden_norm.weight,
        *int8(head.in_proj),
        layer.input_layernorm.weight,
        *int8(attn.qkv_proj),
        *int8(attn.o_proj),
        layer.post_attention_layernorm.weight,
        *int8(mlp.gate_up_proj),
        *int8(mlp.down_proj),
        head.rotary_emb.inv_freq,
    ]
    eps = [
        head.feature_norm.eps,
        head.embed_norm.eps,
        head.hidden_norm.eps,
        layer.input_layernorm.eps,
        layer.post_attention_layernorm.eps,
    ]
    k_cache, v_cache = kv_cache.k_cache[0], kv_cache.v_cache[0]
    num_parts = head.feature_norm.num_parts
    op = torch.ops.specdec_eagle.head_step
    shape = (attn.num_heads, attn.num_kv_heads, attn.scale)

    def step(
        inputs: torch.Tensor,
        project: bool,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: DecodeMetadata,
        ends: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head entries through the C++ step.

        Args:
            inputs: [R, F] target features (`project`: through `project_features` first), or
                [R, D] hidden inputs (projected features or previous head outputs).
            embeds: [R, D] embeddings of the entries' tokens.
            positions: [R] int64 RoPE position of each entry.
            meta: the step's decode metadata over the head's cache (no tree mask, no split-KV).
            ends: [S] int64 rows to return (each request's last entry), or None: all rows.

        Returns: [R, D] (or [S, D]) head outputs, bit for bit those of the Python path.

        Mutates: the `kv_cache` slots in `meta.slot_mapping`.
        """
        return op(
            inputs,
            project,
            embeds,
            positions,
            meta.slot_mapping,
            meta.context_lens,
            meta.query_lens,
            meta.block_tables,
            meta.query_per_seq,
            ends,
            k_cache,
            v_cache,
            weights,
            eps,
            num_parts,
            *shape,
        )

    return step
