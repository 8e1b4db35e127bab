"""MTP layers stored inside a target checkpoint (vLLM's `method: "mtp"`), dense kind, loaded into
an `EagleHead` (an MTP layer is an EAGLE-1-style head with norms), so they draft through the
EAGLE drafter: its chains, trees and device rounds. Reads files; never samples.

Head entry t joins the target's hidden state h_t with the embedding e of the token at t + 1:

- MiMo (`MiMoForCausalLM`, `model.mtp_layers.{k}.*`), as MiMo's modeling_mimo.py
  (`MiMoMTPLayers.forward`) and vLLM's mimo_mtp.py define it:
      x = input_proj(cat(hidden_layernorm(h_t), token_layernorm(e)))   -- the hidden state FIRST
      o = final_layernorm(decoder_layer(x))    (a Qwen2 layer with its input_layernorm)
      draft logits = lm_head_target(o); a chained entry reads o (normed)
  with h_t the target's last hidden state BEFORE its final norm (vLLM's MiMoModel returns the
  residual stream and norms it only in compute_logits).
- DeepSeek-V3's naming on a dense block (`model.layers.{N + k}.*`, N = num_hidden_layers,
  `num_nextn_predict_layers` in config.json), as vLLM's deepseek_mtp.py defines it:
      x = eh_proj(cat(enorm(e), hnorm(h_t)))   -- the embedding first
      o = decoder_layer(x)
      draft logits = shared_head.head(shared_head.norm(o)); a chained entry reads o (unnormed)
  with h_t the target's last hidden state AFTER its final norm (DeepseekV2Model's output).

Chains over a checkpoint's n MTP layers (`load_mtp_heads`, one `EagleHead` each; drafted by
`mtp_chain.MtpChainDrafter`): layer k drafts position k of a round from layer k - 1's output
(DeepSeek-V3, arXiv:2412.19437, section 2.2: h^k = M_k[RMSNorm(h^{k-1}); RMSNorm(Emb(t_{i+k}))],
then TRM_k and the shared head; MiMo's layers chain the same way), positions k >= n the last
layer fed its own output. One layer (n = 1, or `mtp_layers: 1`) drafts through `EagleDrafter`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from specdec.drafters.eagle.head import EagleConfig, EagleHead, HeadLayout
from specdec.drafters.formats import DrafterCheckpoint
from specdec.models import LlamaForCausalLM
from specdec.models.families import check_llama_layout
from specdec.models.layers import Linear
from specdec.models.weights import CheckpointError, assign_weights

MIMO = "MiMo"  # model.mtp_layers.{k}.*
DEEPSEEK = "DeepSeek-V3"  # model.layers.{N + k}.enorm / hnorm / eh_proj / shared_head

_MIMO_LAYER = re.compile(r"^model\.mtp_layers\.(\d+)\.")
_DEEPSEEK_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")

# EagleHead parameter -> tensor name under the MTP layer's prefix (`layer.*`: the decoder
# layer's own names, directly under the prefix in both namings).
_NAMES = {
    MIMO: {
        "in_proj.weight": "input_proj.weight",
        "embed_norm.weight": "token_layernorm.weight",
        "hidden_norm.weight": "hidden_layernorm.weight",
        "final_norm.weight": "final_layernorm.weight",
    },
    DEEPSEEK: {
        "in_proj.weight": "eh_proj.weight",
        "embed_norm.weight": "enorm.weight",
        "hidden_norm.weight": "hnorm.weight",
        "norm.weight": "shared_head.norm.weight",
        "lm_head.weight": "shared_head.head.weight",
        "embed_tokens.weight": "embed_tokens.weight",
    },
}


def recognise_mtp(checkpoint: DrafterCheckpoint) -> tuple[str, str] | None:
    """Which naming a target checkpoint's MTP layers follow, and layer 0's tensor prefix.

    Returns:
        (MIMO, "model.mtp_layers.0.") for a MiMoForCausalLM config or `model.mtp_layers.*`
        tensors; (DEEPSEEK, "model.layers.{N}.") for `num_nextn_predict_layers` > 0 or
        enorm / hnorm / eh_proj / shared_head tensors past the last layer; None otherwise.
    """
    config, names = checkpoint.config, checkpoint.names
    if "MiMoForCausalLM" in (config.get("architectures") or []) or any(
        _MIMO_LAYER.match(name) for name in names
    ):
        return MIMO, "model.mtp_layers.0."
    num_layers = config.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        return None
    prefix = f"model.layers.{num_layers}."
    if (config.get("num_nextn_predict_layers") or 0) > 0 or any(
        name.startswith(prefix + part) for name in names for part in _DEEPSEEK_PARTS
    ):
        return DEEPSEEK, prefix
    return None


def mtp_prefix(naming: str, checkpoint: DrafterCheckpoint, index: int) -> str:
    """The tensor prefix of MTP layer `index` (0-based) in `naming`."""
    if naming == MIMO:
        return f"model.mtp_layers.{index}."
    return f"model.layers.{checkpoint.config['num_hidden_layers'] + index}."


def count_mtp_layers(checkpoint: DrafterCheckpoint, naming: str) -> int:
    """How many MTP layers the checkpoint has: config.json's `num_nextn_predict_layers` when it
    states one (its layers' tensors are then required), else the layers whose tensors are
    stored (MiMo: the highest `model.mtp_layers.{k}` + 1; DeepSeek-V3: consecutive layers
    N, N + 1, .. with enorm / hnorm / eh_proj / shared_head tensors; at least 1)."""
    stated = checkpoint.config.get("num_nextn_predict_layers")
    if isinstance(stated, int) and not isinstance(stated, bool) and stated > 0:
        return stated
    names = checkpoint.names
    if naming == MIMO:
        indices = [int(m.group(1)) for m in map(_MIMO_LAYER.match, names) if m is not None]
        return max(indices, default=0) + 1
    count = 1
    while any(
        name.startswith(mtp_prefix(naming, checkpoint, count) + part)
        for name in names
        for part in _DEEPSEEK_PARTS
    ):
        count += 1
    return count


def mtp_cache_layers(model: str | None, mtp_layers: str | int = "all") -> int:
    """Paged-cache layers the "mtp" drafter of `model` keeps beside the target's, one per
    chained MTP layer (an engine sizing its caches counts these; 1 for one layer, an EAGLE
    head, or a `model` not read yet)."""
    if model is None or not Path(model).is_dir():
        return 1
    try:
        checkpoint = DrafterCheckpoint(model)
    except FileNotFoundError:
        return 1
    found = recognise_mtp(checkpoint)
    if found is None:
        return 1
    return count_mtp_layers(checkpoint, found[0]) if mtp_layers == "all" else int(mtp_layers)


def no_mtp_message(path: object) -> str:
    """The one-line refusal of `method: "mtp"` on a checkpoint without MTP layers."""
    return (
        f'{path} has no MTP layers: speculative_config method "mtp" reads model.mtp_layers.{{k}}.* '
        "(MiMo) or model.layers.{N + k}.enorm/hnorm/eh_proj/shared_head with "
        "num_nextn_predict_layers (DeepSeek-V3) from the target's checkpoint, or an EAGLE head "
        "directory"
    )


def load_mtp_heads(
    checkpoint: DrafterCheckpoint,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
    num_layers: int | None = None,
) -> list[EagleHead]:
    """Loads the first `num_layers` MTP layers of `checkpoint` (None: all it has,
    `count_mtp_layers`), one `EagleHead` each, in order.

    Raises:
        ValueError: `num_layers` above the layers the checkpoint has (named, as the
            `speculative_config` key `mtp_layers`); what `load_mtp_head` raises.
        CheckpointError: a layer's missing or mis-shaped tensor, named (as `load_mtp_head`).
    """
    found = recognise_mtp(checkpoint)
    if found is None:
        raise ValueError(no_mtp_message(checkpoint.path))
    have = count_mtp_layers(checkpoint, found[0])
    if num_layers is not None and num_layers > have:
        raise ValueError(
            f"speculative_config mtp_layers {num_layers}: {checkpoint.path} has {have} MTP "
            f"layer{'s' if have > 1 else ''}"
        )
    wanted = have if num_layers is None else num_layers
    return [load_mtp_head(checkpoint, target, dtype, device, k) for k in range(wanted)]


def load_mtp_head(
    checkpoint: DrafterCheckpoint,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
    index: int = 0,
) -> EagleHead:
    """Loads MTP layer `index` (0-based) of `checkpoint` (the target's own directory, or one of
    the same shape) into an `EagleHead` wired as the module docstring says. As a chained
    layer (index > 0) its `hidden` input is the previous layer's output, so its
    `feature_norm` (the target's final norm, DeepSeek-V3 naming) is not read.

    Raises:
        ValueError: no MTP layers (`no_mtp_message`); a checkpoint of another width or
            vocabulary than the target; a target whose layers are not Llama's.
        CheckpointError: a missing or mis-shaped tensor of the layer, or a tensor under its
            prefix that the naming does not define (a MoE block's experts), each named.
    """
    found = recognise_mtp(checkpoint)
    if found is None:
        raise ValueError(no_mtp_message(checkpoint.path))
    naming = found[0]
    prefix = mtp_prefix(naming, checkpoint, index)
    config = target.config
    check_llama_layout(config, "MTP drafting")
    source = str(checkpoint.path)
    mismatches = [
        f"{name} {checkpoint.config.get(name)} vs the target's {theirs}"
        for name, theirs in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size))
        if checkpoint.config.get(name, theirs) != theirs
    ]
    if mismatches:
        raise ValueError(f"{source}: these MTP layers do not fit the target: {mismatches}")
    layer = dataclasses.replace(config, num_hidden_layers=1, tie_word_embeddings=False)
    if layer.eager_only_reason is not None:  # the head's decode path has one frequency table
        raise ValueError(f"{source}: MTP drafting for a target with {layer.eager_only_reason}")
    if config.has_sliding_window:  # the head's eager attention (eagle/head.py) has no window
        raise ValueError(f"{source}: MTP drafting for a target with sliding-window attention")
    names = _NAMES[naming]
    deepseek = naming == DEEPSEEK
    # DeepSeek-V3 stores the shared embedding and LM head again in each MTP layer (vLLM reads
    # them as the target's): the layer's own only where their values differ.
    shared = {}
    if deepseek:
        embed_name = prefix + names["embed_tokens.weight"]
        lm_name = prefix + names["lm_head.weight"]
        checkpoint.require(lm_name, (config.vocab_size, config.hidden_size))  # (named)
        shared = {
            embed_name: checkpoint.stores_other(embed_name, target.model.embed_tokens.weight),
            lm_name: checkpoint.stores_other(
                lm_name, None if target.lm_head_quantized is not None else target.lm_head_weight
            ),
        }
    layout = HeadLayout(
        feature_fc=False,
        input_norms=True,
        in_proj_bias=False,
        layer_input_norm=True,
        output_norm=True,
        own_embedding=shared.get(prefix + "embed_tokens.weight", False),
        feature_norm=deepseek,
        hidden_first=not deepseek,
        norm_fed_back=not deepseek,
    )
    head_config = EagleConfig(
        hidden_size=config.hidden_size,
        feature_layers=(config.num_hidden_layers - 1,),
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        target_vocab_size=config.vocab_size,
        target_num_hidden_layers=config.num_hidden_layers,
        layout=layout,
        layer=layer,
    )
    with torch.device("meta"):
        head = EagleHead(head_config)
        if shared.get(prefix + "shared_head.head.weight"):
            head.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
    used = set(shared)  # (read whether or not they are the layer's own)
    tensors = {}
    for name, param in head.named_parameters():
        if name == "feature_norm.weight":
            continue
        stored = prefix + (
            name.removeprefix("layer.") if name.startswith("layer.") else names[name]
        )
        tensors[name] = checkpoint.require(stored, param.shape)
        used.add(stored)
    unused = sorted(n for n in checkpoint.names if n.startswith(prefix) and n not in used)
    if unused:
        shown = ", ".join(repr(n) for n in unused[:8])
        raise CheckpointError(
            f"{source}: tensors that a dense {naming} MTP layer does not define: {shown}"
        )
    if deepseek:  # the feature is the target's last hidden state after its final norm
        tensors["feature_norm.weight"] = target.model.norm.weight.detach()
    assign_weights(head, tensors.get, source, dtype, device)
    if deepseek:
        head.feature_norm.eps = target.model.norm.eps
    return head
