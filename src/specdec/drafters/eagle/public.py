"""EAGLE heads from public checkpoints (`load_head` picks the format): EAGLE-1/2 into `EagleHead`,
as below; EAGLE-3 into `eagle3.Eagle3Head` (its module says how).

EAGLE-1/2 (SafeAILab's format, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B; vLLM's "eagle" method with
a Llama head), as EAGLE's eagle/model/cnets1.py and ea_model.py define it (vLLM's
llama_eagle.py agrees): head entry t computes

    x_t = fc(cat(embed(token at t + 1), h_t)) (+ fc.bias when the checkpoint stores it)
    o_t = layer(x_t), a Llama decoder layer WITHOUT input_layernorm (EAGLE skips it in layer 0)
    draft logits = lm_head_target(o_t) (no norm before the target's LM head)

where h_t is the target's last hidden state AFTER its final norm (`base_model.model(...)[0]`)
for an entry fed from the target, and o_{t-1} (the head's own output, unnormed) for a chained
draft step. In `EagleHead` terms: `feature_norm` holds the target's final norm (weight and eps),
there is no `fc`, no embed/hidden norms (unless the config sets HASS's `add_para_norm`), `in_proj`
is EAGLE's `fc`, and no output norm. The head's embedding is the target's, unless the checkpoint
stores `embed_tokens.weight` with other values (then the head keeps its own table, as EAGLE's
strict load does). EAGLE positions entry t at t, this engine at t + 1: RoPE only sees the
difference, so the attention is the same. Reads files; never samples.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specdec.drafters.eagle.eagle3 import Eagle3Head, load_eagle3_head
from specdec.drafters.eagle.head import (
    EagleConfig,
    EagleHead,
    HeadLayout,
    load_eagle_head,
    quantize_head_int8,
)
from specdec.drafters.formats import (
    EAGLE3,
    SPECDEC_EAGLE,
    DrafterCheckpoint,
    recognise_eagle,
    strip_prefix,
)
from specdec.drafters.mtp import load_mtp_head, no_mtp_message, recognise_mtp
from specdec.models import LlamaForCausalLM
from specdec.models.config import ModelConfig
from specdec.models.weights import CheckpointError, assign_weights

# EagleHead parameter -> EAGLE-1/2 tensor name (before any `model.` prefix); `layer.*` are
# `layers.0.*`, and `feature_norm.weight` comes from the target.
_EAGLE1_NAMES = {
    "in_proj.weight": "fc.weight",
    "in_proj.bias": "fc.bias",
    "embed_norm.weight": "embedding_layernorm.weight",  # HASS (add_para_norm)
    "hidden_norm.weight": "hidden_states_layernorm.weight",
    "embed_tokens.weight": "embed_tokens.weight",
}
# Stored by some EAGLE-1 checkpoints and not part of the math: vLLM drops layer 0's input norm
# (an identity, as in EAGLE's cnets1.py) and skips this tensor; EAGLE never creates it.
_EAGLE1_IGNORED = ("layers.0.input_layernorm.weight",)


def load_head(
    path: str | Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
    method: str = "eagle",
    int8_linears: bool = False,
) -> tuple[EagleHead | Eagle3Head, torch.Tensor | None]:
    """Loads the EAGLE head in `path`, whichever format `recognise_eagle` finds there
    (`method` "eagle3", vLLM's name for EAGLE-3 heads, takes those only; "mtp" first looks for
    MTP layers in a target checkpoint there: `drafters.mtp`); with `int8_linears`, its linears
    made int8 (`head.quantize_head_int8`; a head of this engine's format as it is read).

    Returns:
        (head in eval mode without grads, draft_to_target [V_draft] int64 or None).

    Raises:
        FileNotFoundError, CheckpointError, ValueError: a missing file; a format not loaded
        (named); a missing or mis-shaped tensor (named); a head made for another target; a
        head that is not EAGLE-3 under "eagle3"; neither MTP layers nor a head under "mtp".
    """
    if method == "mtp" and not Path(path).is_dir():
        raise ValueError(
            f'{path}: speculative_config method "mtp" reads MTP layers (or a head) from a '
            "Hugging Face directory (config.json and safetensors files), not a file"
        )
    checkpoint = DrafterCheckpoint(path)
    if method == "mtp":
        if recognise_mtp(checkpoint) is not None:
            return _int8(load_mtp_head(checkpoint, target, dtype, device), int8_linears), None
        try:
            recognise_eagle(checkpoint)
        except CheckpointError:
            raise ValueError(no_mtp_message(path)) from None
    kind = recognise_eagle(checkpoint)
    if method == "eagle3" and kind != EAGLE3:
        raise ValueError(
            f'{path} holds a {kind} head, not an EAGLE-3 one: speculative_config method "eagle3" '
            'takes EAGLE-3 heads; use "eagle" for this one'
        )
    if kind == SPECDEC_EAGLE:  # quantized as it is read
        return load_eagle_head(path, target.config, dtype, device, int8_linears)
    if kind == EAGLE3:
        head, draft_to_target = load_eagle3_head(checkpoint, target, dtype, device)
        return _int8(head, int8_linears), draft_to_target
    return _int8(load_eagle1_head(checkpoint, target, dtype, device), int8_linears), None


def _int8(head: EagleHead | Eagle3Head, int8_linears: bool) -> EagleHead | Eagle3Head:
    """`head`, with `int8_linears` made int8 where it can be (`quantize_head_int8`)."""
    if int8_linears:
        quantize_head_int8(head)
    return head


def eagle1_config(
    checkpoint: DrafterCheckpoint, target: ModelConfig, own_embedding: bool
) -> EagleConfig:
    """The EagleConfig of an EAGLE-1/2 head (its config.json is a Llama config of one layer).

    Raises:
        ValueError: a head of more than one layer, or of another width or vocabulary than
            the target's; dynamic NTK RoPE; what `ModelConfig.from_hf_config` refuses (e.g.
            not SiLU)."""
    values = dict(checkpoint.config)
    source = str(checkpoint.path)
    num_layers = values.get("num_hidden_layers", 1)
    if num_layers != 1:
        raise ValueError(f"{source}: an EAGLE-1/2 head of {num_layers} layers (only 1 is loaded)")
    values.setdefault("vocab_size", target.vocab_size)
    # Llama numerics whatever the base architecture; q/k/v biases only where EAGLE's code reads
    # `qkv_bias` (its Qwen2 heads), never o_proj or MLP biases.
    layer = ModelConfig.from_hf_config({**values, "architectures": ["LlamaForCausalLM"]})
    layer = dataclasses.replace(
        layer,
        attention_bias=bool(values.get("qkv_bias", False)),
        attention_out_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    if layer.eager_only_reason is not None:  # the head's decode path has one frequency table
        raise ValueError(f"{source}: an EAGLE-1/2 head with {layer.eager_only_reason}")
    mismatches = [
        f"{name} {mine} vs the target's {theirs}"
        for name, mine, theirs in (
            ("hidden_size", layer.hidden_size, target.hidden_size),
            ("vocab_size", layer.vocab_size, target.vocab_size),
        )
        if mine != theirs
    ]
    if mismatches:
        raise ValueError(f"{source}: this EAGLE-1/2 head does not fit the target: {mismatches}")
    prefix = strip_prefix(checkpoint.names, "model.")
    layout = HeadLayout(
        feature_fc=False,
        input_norms=bool(values.get("add_para_norm", False)),
        in_proj_bias=f"{prefix}fc.bias" in checkpoint.names,
        layer_input_norm=False,
        output_norm=False,
        own_embedding=own_embedding,
    )
    return EagleConfig(
        hidden_size=layer.hidden_size,
        feature_layers=(target.num_hidden_layers - 1,),  # normed by `feature_norm` below
        intermediate_size=layer.intermediate_size,
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=layer.num_key_value_heads,
        head_dim=layer.head_dim,
        rms_norm_eps=layer.rms_norm_eps,
        rope_theta=layer.rope_theta,
        max_position_embeddings=layer.max_position_embeddings,
        target_vocab_size=target.vocab_size,
        target_num_hidden_layers=target.num_hidden_layers,
        layout=layout,
        layer=layer,
    )


def load_eagle1_head(
    checkpoint: DrafterCheckpoint,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
) -> EagleHead:
    """Loads an EAGLE-1/2 checkpoint into an `EagleHead` wired as the module docstring says.

    Raises:
        CheckpointError: a missing or mis-shaped tensor, or a tensor the format does not
            define (each named by its name in the checkpoint).
        ValueError: as `eagle1_config`.
    """
    prefix = strip_prefix(checkpoint.names, "model.")
    own_embedding = checkpoint.stores_other(
        prefix + "embed_tokens.weight", target.model.embed_tokens.weight
    )
    config = eagle1_config(checkpoint, target.config, own_embedding)
    with torch.device("meta"):
        head = EagleHead(config)
    # Read whether or not it is the head's own: the target's table when equal to it.
    used = {prefix + name for name in (*_EAGLE1_IGNORED, "embed_tokens.weight")}
    tensors = {}
    for name, param in head.named_parameters():
        if name == "feature_norm.weight":
            continue
        stored = prefix + (
            f"layers.0.{name.removeprefix('layer.')}"
            if name.startswith("layer.")
            else _EAGLE1_NAMES[name]
        )
        tensors[name] = checkpoint.require(stored, param.shape)
        used.add(stored)
    checkpoint.refuse_unused(used, "EAGLE-1/2")
    # The feature is the target's last hidden state after its final norm: that norm, exactly.
    final_norm = target.model.norm
    tensors["feature_norm.weight"] = final_norm.weight.detach()
    assign_weights(head, tensors.get, str(checkpoint.path), dtype, device)
    head.feature_norm.eps = final_norm.eps
    return head
