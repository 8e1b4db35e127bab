"""Writing an `EagleHead` in the EAGLE-1/2 layout other engines load (SafeAILab's cnets1.py, vLLM's
`method: "eagle"` through llama_eagle.py): config.json a one-layer `LlamaForCausalLM` config,
model.safetensors with `fc.weight` and `layers.0.*` (no `input_layernorm`), and HASS's
`embedding_layernorm` / `hidden_states_layernorm` under `add_para_norm`.

Only a head whose math is exactly that layout is written; any other is refused, naming each
difference (no norm is folded or dropped: that would change the drafts). `export_head` also
writes EAGLE-3 heads (`export_eagle3`). Never samples.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from specdec.drafters.eagle.head import EagleHead, HeadLayout
from specdec.models.config import ModelConfig

# `export_head`'s formats: EAGLE-1/2 (here) and EAGLE-3 (`export_eagle3`: EAGLE-3 heads only).
EXPORT_FORMATS = ("eagle", "eagle3")

# EagleHead parameter -> its EAGLE-1/2 name (`layer.*` are `layers.0.*`); `feature_norm` is the
# target's final norm, which the format does not store.
_EXPORT_NAMES = {
    "in_proj.weight": "fc.weight",
    "embed_norm.weight": "embedding_layernorm.weight",
    "hidden_norm.weight": "hidden_states_layernorm.weight",
}


def eagle1_refusals(head: EagleHead, draft_to_target: torch.Tensor | None, target) -> list[str]:
    """Why `head` is not exactly an EAGLE-1/2 head over `target` (a `LlamaForCausalLM`): one
    line per difference, empty when `write_eagle1` may write it."""
    config, layout = head.config, head.config.layout
    reasons = []
    if layout.feature_fc:
        reasons.append(
            "feature_fc: the head passes the target feature through its own fc [D, F] before "
            "joining it with the embedding (EAGLE-1/2 join the target's hidden state as it is)"
        )
    if layout.layer_input_norm:
        reasons.append(
            "layer_input_norm: the head's layer normalises its input (EAGLE-1/2 and vLLM's "
            "llama_eagle.py make layer 0's input_layernorm the identity)"
        )
    if layout.output_norm:
        reasons.append(
            "output_norm: the head normalises its output before the LM head (EAGLE-1/2 give it "
            "to the target's LM head as it is, and feed it back unnormed)"
        )
    if layout.in_proj_bias:
        reasons.append("fc.bias: vLLM's llama_eagle.py builds fc without a bias and skips it")
    if layout.own_embedding:
        reasons.append(
            "embed_tokens: the head has a table of its own (vLLM shares the target's and skips "
            "a stored one)"
        )
    if draft_to_target is not None:
        reasons.append("draft_vocab_size: EAGLE-1/2 draft over the target's whole vocabulary")
    last = target.config.num_hidden_layers - 1
    if tuple(config.feature_layers) != (last,):
        reasons.append(
            f"feature_layers {list(config.feature_layers)}: EAGLE-1/2 read the target's last "
            f"layer ({last}) only"
        )
    else:
        final_norm = target.model.norm
        same_weight = torch.equal(
            head.feature_norm.weight.detach().float().cpu(),
            final_norm.weight.detach().float().cpu(),
        )
        if not same_weight or head.feature_norm.eps != final_norm.eps:
            reasons.append(
                "feature_norm: not the target's final norm (EAGLE-1/2 read the target's hidden "
                "state after that norm)"
            )
    layer = config.layer_config()
    if _math(layer) != _math(_layer_from_json(eagle1_config_json(head))):
        reasons.append(
            "the head's layer is not a plain Llama layer a one-layer Llama config states "
            "(biases, RoPE scaling, norms or activation of another kind)"
        )
    if layout.input_norms and layer.rms_norm_eps != config.rms_norm_eps:
        reasons.append("input norms: their eps differs from the layer's (one rms_norm_eps)")
    return reasons


def eagle1_config_json(head: EagleHead) -> dict:
    """The config.json of `head` as an EAGLE-1/2 head: the keys vLLM's Llama layer and
    SafeAILab's cnets1.py read (`bias` false: fc has none; `add_para_norm` for HASS's norms)."""
    layer = head.config.layer_config()
    values = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": layer.hidden_act,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "max_position_embeddings": layer.max_position_embeddings,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "vocab_size": layer.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": False,
        "torch_dtype": "float32",
    }
    if head.config.layout.input_norms:
        values["add_para_norm"] = True
    return values


def _layer_from_json(values: dict) -> ModelConfig:
    """The layer config our EAGLE-1/2 loader (`public.eagle1_config`) reads from `values`."""
    layer = ModelConfig.from_hf_config(values)
    return dataclasses.replace(
        layer,
        attention_bias=False,
        attention_out_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )


def _math(layer: ModelConfig) -> ModelConfig:
    """`layer` without the fields that do not change its math (ids, saved dtype)."""
    return dataclasses.replace(layer, bos_token_id=None, eos_token_ids=(), torch_dtype=None)


def eagle1_tensors_of(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's parameters under their EAGLE-1/2 names, in `dtype` on the CPU."""
    tensors = {}
    for name, param in head.named_parameters():
        if name == "feature_norm.weight":
            continue
        stored = (
            f"layers.0.{name.removeprefix('layer.')}"
            if name.startswith("layer.")
            else _EXPORT_NAMES[name]
        )
        tensors[stored] = param.detach().to("cpu", dtype).contiguous()
    return tensors


def write_eagle1(
    head: EagleHead,
    draft_to_target: torch.Tensor | None,
    target,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Writes `head` as an EAGLE-1/2 directory (config.json + model.safetensors) in `out_dir`.

    Args:
        head: the head (a layout without `feature_fc`, `layer_input_norm`, `output_norm`).
        draft_to_target: [V_draft] int64 or None (must be None: the full vocabulary).
        target: the `LlamaForCausalLM` it drafts for (its final norm is the head's feature norm).
        out_dir: created if missing.
        dtype: of the written tensors (float32: the loaded head equals this one bit for bit).

    Raises:
        ValueError: the head is not exactly that layout (each difference named).
    """
    reasons = eagle1_refusals(head, draft_to_target, target)
    if reasons:
        raise ValueError(
            "this head cannot be written as an EAGLE-1/2 head without changing its drafts: "
            + "; ".join(reasons)
        )
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = eagle1_config_json(head)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file(eagle1_tensors_of(head, dtype), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def export_head(src: str | Path, dst: str | Path, fmt: str, target) -> Path:
    """Loads the EAGLE head in `src` (any format `public.load_head` reads) for `target` and
    writes it in `dst` in format `fmt` ("eagle": EAGLE-1/2; "eagle3": EAGLE-3 as vLLM and
    SGLang both load it, `export_eagle3.write_eagle3`), in float32.

    Raises:
        ValueError: an unknown format, or a head that is not exactly that format's layout
            (e.g. every head `train-drafter --kind eagle` trains in specdec's layout, whose
            input, layer and output norms EAGLE-1/2 do not have; under "eagle3", every
            `EagleHead`: another network than EAGLE-3's).
    """
    from specdec.drafters.eagle.export_eagle3 import write_eagle3
    from specdec.drafters.eagle.public import load_head

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r}: one of {list(EXPORT_FORMATS)}")
    head, draft_to_target = load_head(src, target, torch.float32, "cpu")
    if fmt == "eagle3":
        return write_eagle3(head, draft_to_target, target, dst)
    if not isinstance(head, EagleHead):
        raise ValueError(f"{src} holds an EAGLE-3 head: it is not written as EAGLE-1/2")
    return write_eagle1(head, draft_to_target, target, dst)


# The layout an EAGLE-1/2 head has in `EagleHead` (as `public.eagle1_config` loads one without
# a bias, a table of its own or HASS's norms): what `train-drafter --format eagle` trains.
EAGLE1_LAYOUT = HeadLayout(
    feature_fc=False, input_norms=False, layer_input_norm=False, output_norm=False
)
