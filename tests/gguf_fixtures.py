"""Test helpers that write GGUF files as llama.cpp's converter does (Q/K permuted, its tensor
names, Gemma's norm offsets, Phi-3's fused tensors and LongRoPE factors), from `transformers`
models, for the loader's tests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from models_fixtures import FULL_ATTENTION


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py Q/K row permutation (what the loader must undo)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections, kept whole
    "mlp.gate_up_proj": "ffn_up",
}


# Gemma's four norms a layer, as llama.cpp's converter names them.
_GGUF_GEMMA_LAYER_PARTS = {
    **_GGUF_LAYER_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GEMMA_ARCHS = ("gemma2", "gemma3")
# OLMo 2's post norms, as llama.cpp's converter names them (Gemma's names).
_GGUF_OLMO2_LAYER_PARTS = {
    **_GGUF_LAYER_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of a HF parameter name (the converter's mapping for `arch`)."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    parts = (
        _GGUF_GEMMA_LAYER_PARTS
        if arch in _GGUF_GEMMA_ARCHS
        else _GGUF_OLMO2_LAYER_PARTS
        if arch == "olmo2"
        else _GGUF_LAYER_PARTS
    )
    return f"blk.{layer}.{parts[part]}.{kind}"


def write_gguf(
    path: Path,
    hf_model: Any,
    *,
    arch: str,
    qtype_of: dict[str, Any] | None = None,
    rope_freqs: np.ndarray | None = None,
    tokenizer: dict[str, Any] | None = None,
    rope_scaling: dict[str, Any] | None = None,
    stacked_experts: bool = True,
) -> Path:
    """Writes a `transformers` model as llama.cpp's converter would (Q/K permuted for "llama";
    for Gemma 1 added to every norm weight, its window, soft-capping and linear RoPE scaling
    in the metadata, no RoPE base for Gemma 2; Phi-3's metadata and LongRoPE factor tensors
    as `_write_phi3` says).

    Args:
        path: output file.
        hf_model: the model whose weights and config are written.
        arch: GGUF architecture ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2",
            "phi3", "qwen3moe"; a Mixtral as "llama"). A mixture of experts' stacked expert
            tensors are written as llama.cpp stores them (`ffn_{gate,up,down}_exps`,
            [E, F, D] / [E, D, F]).
        qtype_of: GGUF tensor name -> GGMLQuantizationType (default F32).
        rope_freqs: [head_dim // 2] Llama 3.1 frequency factors, written as `rope_freqs.weight`.
        tokenizer: optional tokenizer metadata (tokens, token_types, merges, bos/eos, template).
        rope_scaling: `{arch}.rope.scaling.<key>` values (str, int as uint32, float as float32,
            None left out; for "phi3" they replace the converter's).
        stacked_experts: False writes one tensor per expert (`ffn_gate.E`, older Mixtral files).
    """
    import gguf

    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch != "phi3":  # its converter writes neither (nor the vocabulary's size)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch != "gemma2":
        rope = config.rope_parameters
        writer.add_rope_freq_base(rope.get(FULL_ATTENTION, rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "phi3":
        _write_phi3(writer, config, rope_scaling or {})
    else:
        writer.add_vocab_size(config.vocab_size)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "norm_topk_prob", True) is False:
            writer.add_bool(f"{arch}.expert_weights_norm", False)
    if arch in _GGUF_GEMMA_ARCHS:
        writer.add_sliding_window(config.sliding_window)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, key, None) is not None:
                writer.add_float32(f"{arch}.{key}", getattr(config, key))
        full = config.rope_parameters.get(FULL_ATTENTION, {})
        if full.get("rope_type", "default") == "linear":
            writer.add_string(f"{arch}.rope.scaling.type", "linear")
            writer.add_float32(f"{arch}.rope.scaling.factor", full["factor"])
    for key, value in (rope_scaling or {}).items():
        name = f"{arch}.rope.scaling.{key}"
        if value is None:  # left out
            continue
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_float32(name, value)
    if arch == "phi3" and rope_freqs is not None:
        raise ValueError("phi3 files carry LongRoPE factors, not rope_freqs.weight")
    if tokenizer is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tokenizer.get("pre", "default"))
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["token_types"])
        writer.add_token_merges(tokenizer["merges"])
        writer.add_bos_token_id(tokenizer["bos_token_id"])
        writer.add_eos_token_id(tokenizer["eos_token_id"])
        writer.add_add_bos_token(tokenizer.get("add_bos_token", False))
        if "chat_template" in tokenizer:
            writer.add_chat_template(tokenizer["chat_template"])
    qtype_of = qtype_of or {}
    state = {}
    for hf_name, tensor in hf_model.state_dict().items():
        layer, stacked = hf_name.split(".mlp.experts.") if ".mlp.experts." in hf_name else ("", "")
        parts = {}
        if stacked == "gate_up_proj":  # [E, 2F, D], gate rows first: llama.cpp's two tensors
            parts["gate"], parts["up"] = tensor.chunk(2, dim=1)
        elif stacked == "down_proj":
            parts["down"] = tensor
        else:
            state[hf_name] = tensor
        for part, experts in parts.items():
            if stacked_experts:
                state[f"{layer}.ffn_{part}_exps"] = experts
            for index, expert in enumerate(experts if not stacked_experts else ()):
                state[f"{layer}.ffn_{part}.{index}"] = expert
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if ".ffn_" in hf_name:  # model.layers.L.ffn_*_exps, model.layers.L.ffn_*.E: experts
            name = f"blk.{hf_name.split('.', 3)[2]}.{hf_name.split('.', 3)[3]}.weight"
        else:
            name = gguf_tensor_name(hf_name, arch)
        if arch in _GGUF_GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            data = data + 1.0
        if arch == "llama" and ".attn_q." in name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        qtype = qtype_of.get(name, gguf.GGMLQuantizationType.F32)
        stored = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_phi3(writer: Any, config: Any, replaced: dict[str, Any]) -> None:
    """What llama.cpp's converter (`Phi3MiniModel`) writes beyond the common keys: the rotated
    dimensions int(partial_rotary_factor x hidden) // heads, the original context, the window
    (0: none), and for LongRoPE the factors as float32 tensors `rope_factors_long` /
    `rope_factors_short` with the attention factor it derives from the two lengths (its
    `sqrt(1 + ln(s) / ln(original))`, s their ratio, 1 for s <= 1), unless `replaced` gives
    one (`rope.scaling.<key>` values the caller writes instead)."""

    rope = config.rope_parameters
    partial = rope.get("partial_rotary_factor", 1.0)
    original = config.original_max_position_embeddings
    writer.add_rope_dimension_count(int(partial * config.hidden_size) // config.num_attention_heads)
    if "original_context_length" not in replaced:
        writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    if not rope.get("long_factor"):
        return
    scale = config.max_position_embeddings / original
    if "attn_factor" not in replaced:
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)
    for key, name in (("long_factor", "rope_factors_long"), ("short_factor", "rope_factors_short")):
        writer.add_tensor(f"{name}.weight", np.asarray(rope[key], dtype=np.float32))
