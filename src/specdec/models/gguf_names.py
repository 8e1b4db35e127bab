"""llama.cpp's tensor names against HF's: the names of each GGUF architecture's layers
(`hf_tensor_name`), the rows of Phi-3's fused tensors that hold each of our projections
(`phi3_fused_rows`) and the Q/K row order llama.cpp's converter stores for Llama
(`reverse_permute_qk`). Read by `gguf_file.GGUFFile`; it never reads a file.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.models.config import ModelConfig

# llama.cpp stores these architectures' norm weights as 1 + w (Gemma's RMSNorm scales by it).
_SHIFTED_NORM_ARCHITECTURES = ("gemma2", "gemma3")

_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# Gemma's four norms a layer: llama.cpp's `ffn_norm` is the norm before the MLP there.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp fixes in code for Gemma files (llama-model.cpp's hyper-parameters): every
# `pattern`-th layer attends to its whole context and the others within the window (the
# window Gemma 2 takes when the file names none); Gemma 3's sliding layers rotate with base
# 10000, unscaled; the 27B models (by layer count) scale attention by (hidden / heads)^-1/2,
# the others by head_dim^-1/2.
# OLMo 2's two norms a layer, each after its sublayer (no norm before either): llama.cpp's
# converter names them as Gemma's post norms; its q/k norms span the whole projection.
_OLMO2_LAYER_NAMES = {
    **{part: name for part, name in _LAYER_NAMES.items() if not part.endswith("_norm")},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Phi-3's layers: llama.cpp's converter keeps its fused projections whole (`attn_qkv`: q rows,
# then k, then v; `ffn_up`: gate rows, then up, the halves ggml's swiglu takes), Q/K not
# permuted (NeoX-style RoPE); our projection -> (the fused tensor, the part's index in it).
_PHI3_LAYER_NAMES = {
    part: _LAYER_NAMES[part] for part in ("attn_norm", "ffn_norm", "attn_output", "ffn_down")
}
_PHI3_FUSED = {
    "self_attn.q_proj": ("attn_qkv", 0),
    "self_attn.k_proj": ("attn_qkv", 1),
    "self_attn.v_proj": ("attn_qkv", 2),
    "mlp.gate_proj": ("ffn_up", 0),
    "mlp.up_proj": ("ffn_up", 1),
}
_HF_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight")


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF parameter name of a llama.cpp tensor name in a file of `architecture`
    (`general.architecture`), or None if it has no HF counterpart."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    names = (
        _GEMMA_LAYER_NAMES
        if architecture in _SHIFTED_NORM_ARCHITECTURES
        else _OLMO2_LAYER_NAMES
        if architecture == "olmo2"
        else _PHI3_LAYER_NAMES
        if architecture == "phi3"
        else _LAYER_NAMES
    )
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def phi3_fused_rows(hf_name: str, config: ModelConfig) -> tuple[str, int, int] | None:
    """The fused tensor of a Phi-3 file that holds `hf_name`'s rows (one of our q/k/v or
    gate/up projection weights), their first row in it and their count; None for other names."""
    match = _HF_LAYER_WEIGHT.fullmatch(hf_name)
    if match is None or match[2] not in _PHI3_FUSED:
        return None
    fused, index = _PHI3_FUSED[match[2]]
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    sizes = [q_size, kv_size, kv_size] if fused == "attn_qkv" else [config.intermediate_size] * 2
    return f"blk.{match[1]}.{fused}.weight", sum(sizes[:index]), sizes[index]


def reverse_permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row permutation (`permute` in its convert_hf_to_gguf.py).

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ...; HF rotates halves (x_i, x_{i+D/2}).
    The converter reorders each head's rows from [half0, half1] to interleaved; this restores them.

    Args:
        weight: [num_heads * D, ...] a q/k projection weight ([out, in]) or bias ([out]) as stored.
        num_heads: heads of that projection (query heads for q, key/value heads for k).

    Returns:
        The tensor in HF row order, same shape.
    """
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )
