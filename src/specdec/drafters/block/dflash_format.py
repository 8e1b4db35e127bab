"""z-lab's public DFlash checkpoints (`DFlashDraftModel`, e.g. z-lab/Qwen3-8B-DFlash-b16): their
recognition, the checks that their math is our block drafter's, and their tensors mapped onto
`BlockDrafterModel`. Refuses by name what it would otherwise compute differently; never guesses.

Their equations (z-lab's dflash model.py) against ours, term by term:
- feature = concat over `target_layer_ids` (in that order) of HF's `hidden_states[i + 1]`, the
  output of target layer i before the final norm for i < L - 1 (our `feature_layers`);
- context = hidden_norm(fc(feature)) (our `context_norm(fc(.))`), projected by every layer's
  k_proj / k_norm / RoPE at the context positions and v_proj (our `context_keys_values`);
- block = embed([anchor, mask_token_id x (block_size - 1)]) at positions A-1 .. A-1+block_size-1
  (our anchor row plus `mask_embedding` = the target's embedding row of mask_token_id);
- every layer: Qwen3 pre-norm layer whose queries attend to [context, block] with no mask (our
  `BlockAttention` with `block_mask`); then norm, then the target's LM head;
- row i >= 1 predicts the token at its own position (our `first_predicting_row` 1), so their
  block_size counts the anchor: our `block_size` (predicting rows) is theirs minus one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdec.drafters.block.network import BlockDrafterConfig, BlockDrafterModel
from specdec.drafters.config import MAX_NUM_SPECULATIVE_TOKENS
from specdec.drafters.formats import DrafterCheckpoint, strip_prefix
from specdec.models import LlamaForCausalLM, ModelConfig
from specdec.models.weights import CheckpointError, assign_weights

ZLAB_ARCHITECTURE = "DFlashDraftModel"
# Variants whose math is not the block drafter's: DFlash2's convolutions and candidate selector.
_OTHER_ARCHITECTURES = ("DFlash2DraftModel",)
# Drafter config fields that must equal the target's for the layers to be shaped like its own.
_SAME_AS_TARGET = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "qk_norm",
    "qk_norm_scope",
    "hidden_act",
    "vocab_size",
)
# Options of the newer z-lab code that change the math when set otherwise (value: the identity).
_IDENTITY_OPTIONS = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}


def is_zlab_dflash(config: dict[str, Any]) -> bool:
    """Whether a config.json is z-lab's DFlash format (a `dflash_config` entry or the
    `DFlashDraftModel` architecture) rather than ours (`specdec_drafter`)."""
    if "specdec_drafter" in config:
        return False
    architectures = config.get("architectures") or []
    return "dflash_config" in config or ZLAB_ARCHITECTURE in architectures


def _value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    """A `dflash_config` entry, else the top-level one (as z-lab's code reads them)."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def zlab_config_alone(config: dict[str, Any], source: Path) -> BlockDrafterConfig:
    """The BlockDrafterConfig of a z-lab config.json read without its target (how many layers
    the drafter has, its block and feature layers); the target fields are what the config
    declares (`num_target_layers`, else the least that fits), checked only when it loads
    (`zlab_block_config`).

    Raises:
        CheckpointError: no target_layer_ids or an unreadable layer count, named."""
    layer_ids = _value(config, "target_layer_ids")
    num_layers = config.get("num_hidden_layers")
    if not layer_ids or not isinstance(num_layers, int):
        raise CheckpointError(
            f"{source}: needs dflash_config.target_layer_ids and num_hidden_layers"
        )
    least = max(max(int(i) for i in layer_ids) + 1, num_layers)
    try:
        return BlockDrafterConfig(
            kind="dflash",
            feature_layers=tuple(int(i) for i in layer_ids),
            target_hidden_size=int(config.get("hidden_size", 0)),
            target_vocab_size=int(config.get("vocab_size", 0)),
            target_num_hidden_layers=int(config.get("num_target_layers", least)),
            block_size=int(_value(config, "block_size", 16)) - 1,
            num_hidden_layers=num_layers,
        )
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: {err}") from err


def zlab_block_config(
    checkpoint: DrafterCheckpoint, target_config: ModelConfig
) -> tuple[BlockDrafterConfig, int]:
    """Our BlockDrafterConfig of a z-lab DFlash directory, and its mask_token_id.

    Raises:
        CheckpointError: a variant or option whose math differs, named.
        ValueError: a checkpoint built for another target (shapes, layers, vocabulary).
    """
    config, path = checkpoint.config, checkpoint.path
    architectures = config.get("architectures") or []
    other = [a for a in architectures if a in _OTHER_ARCHITECTURES]
    if other:
        raise CheckpointError(
            f"{path}: {other[0]} (DFlash2: convolutions and a candidate selector) is not loaded; "
            f"only {ZLAB_ARCHITECTURE} is"
        )
    for name, identity in _IDENTITY_OPTIONS.items():
        value = _value(config, name, identity)
        if value != identity and not (name == "final_logit_softcapping" and not value):
            raise CheckpointError(f"{path}: {name}={value!r} is not supported (only {identity})")
    if _value(config, "is_causal"):
        raise CheckpointError(f"{path}: is_causal=true (causal block attention) is not supported")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(
            f"{path}: layer_types {layer_types} has sliding layers; only full attention is"
        )
    layer_ids = _value(config, "target_layer_ids")
    if not layer_ids:
        raise CheckpointError(f"{path}: no dflash_config.target_layer_ids")
    last = target_config.num_hidden_layers - 1
    if last in layer_ids:
        raise CheckpointError(
            f"{path}: target_layer_ids {layer_ids} name the target's last layer {last}, whose HF "
            "hidden state is taken after the final norm; the engine's features are pre-norm"
        )
    mask_token_id = _value(config, "mask_token_id")
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < target_config.vocab_size:
        raise CheckpointError(
            f"{path}: mask_token_id {mask_token_id!r} is not an id of the target's "
            f"{target_config.vocab_size}"
        )
    block_size = int(_value(config, "block_size", 16))
    if not 2 <= block_size <= MAX_NUM_SPECULATIVE_TOKENS + 1:
        raise CheckpointError(
            f"{path}: block_size {block_size} must be in [2, {MAX_NUM_SPECULATIVE_TOKENS + 1}]"
        )
    hf = {**config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    try:
        layers = ModelConfig.from_hf_config(hf)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the drafter's layer config: {err}") from err
    differ = [
        f"{name} {getattr(layers, name)!r} (target {getattr(target_config, name)!r})"
        for name in _SAME_AS_TARGET
        if getattr(layers, name) != getattr(target_config, name)
    ]
    if differ:
        raise ValueError(
            f"{path}: the drafter's layers are not shaped like this target's: {', '.join(differ)}"
        )
    num_target_layers = config.get("num_target_layers", target_config.num_hidden_layers)
    if num_target_layers != target_config.num_hidden_layers:
        raise ValueError(
            f"{path}: the drafter was built for a target of {num_target_layers} layers, this "
            f"target has {target_config.num_hidden_layers}"
        )
    block = BlockDrafterConfig(
        kind="dflash",
        feature_layers=tuple(int(i) for i in layer_ids),
        target_hidden_size=target_config.hidden_size,
        target_vocab_size=target_config.vocab_size,
        target_num_hidden_layers=target_config.num_hidden_layers,
        block_size=block_size - 1,
        num_hidden_layers=layers.num_hidden_layers,
    )
    return block, mask_token_id


def load_zlab_dflash(path: str | Path, target: LlamaForCausalLM) -> BlockDrafterModel:
    """Loads a z-lab DFlash directory into our block drafter, in the target's dtype and device.

    Names: fc.weight, hidden_norm.weight (our context_norm), norm.weight and layers.{i}.* as they
    are (optionally under `model.`); the mask embedding is the target's embedding row of
    mask_token_id (z-lab embeds the mask token through the target's table).

    Raises:
        FileNotFoundError: no config.json or safetensors file.
        CheckpointError: a differing variant or option, a missing, misshaped or unknown tensor.
        ValueError: a checkpoint built for another target.
    """
    checkpoint = DrafterCheckpoint(path)
    config, mask_token_id = zlab_block_config(checkpoint, target.config)
    prefix = strip_prefix(checkpoint.names, "model.")
    renamed = {"context_norm.weight": "hidden_norm.weight"}
    embedding = target.model.embed_tokens.weight
    used: set[str] = set()

    def read(name: str) -> torch.Tensor | None:
        if name == "mask_embedding":
            return embedding[mask_token_id].detach().clone()
        stored = prefix + renamed.get(name, name)
        used.add(stored)
        tensor = checkpoint.read(stored)
        if tensor is None:
            raise CheckpointError(f"{path}: missing tensor {stored!r} (the drafter's {name})")
        return tensor

    with torch.device("meta"):
        model = BlockDrafterModel(config, target.config)
    assign_weights(model, read, str(path), target.dtype, target.device)
    checkpoint.refuse_unused(used, f"z-lab's {ZLAB_ARCHITECTURE} (as the block drafter loads it)")
    return model
