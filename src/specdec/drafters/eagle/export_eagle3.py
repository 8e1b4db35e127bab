"""Writing an EAGLE-3 head in the one layout both vLLM (`Eagle3LlamaForCausalLM`, llama_eagle3.py)
and SGLang (`LlamaForCausalLMEagle3`, llama_eagle3.py) load: config.json a one-layer Llama config
with architectures ["LlamaForCausalLMEagle3"] (SGLang's class; vLLM's registry maps the name to
its own), `draft_vocab_size`, and the capture ids under both engines' keys; model.safetensors with
`fc.weight` [D, 3D], `midlayer.*`, `norm.weight`, `lm_head.weight` [V_draft, D] (the target's LM
head rows when the head scores with it), `d2t` [V_draft] int64 (target id - draft id) and `t2d`
[V] bool.

Capture ids (`eagle3.capture_layers` reads them back): none when the head reads the engines'
default layers; else `eagle_aux_hidden_state_layer_ids` = k + 1 for the output of layer k (vLLM
reads it as the input of that layer) and `eagle_config.eagle_aux_hidden_state_layer_ids` = k
(SGLang adds 1 and captures the same input).

Only a head both loaders compute exactly is written; anything else is refused, naming each
difference: heads of the `EagleHead` family (trained here, EAGLE-1/2, MTP) are another network
(an `in_proj` [D, 2D] feeding a normed decoder layer, where EAGLE-3's midlayer attends over the
2D-wide [input_layernorm(embedding), hidden_norm(hidden)] with the hidden as its residual), so
they are never written as EAGLE-3. Reads and writes files; never samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.drafters.eagle.eagle3 import Eagle3Head

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Why an `EagleHead` is not written as EAGLE-3 (the refusal, named).
EAGLE_HEAD_REASON = (
    "an EagleHead (a head trained here, EAGLE-1/2 or MTP layers) is another network than "
    "EAGLE-3's: it projects [embedding, hidden] to D with in_proj and runs a decoder layer over "
    "that, where EAGLE-3's midlayer attends over the 2D-wide [input_layernorm(embedding), "
    "hidden_norm(hidden)] with the hidden as its residual and reads fc over three raw target "
    "states; no exact rewrite exists"
)


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """The outputs of target layers that vLLM's and SGLang's default ids capture (the inputs of
    layers 2, N // 2, N - 3)."""
    return tuple(sorted(k - 1 for k in (2, num_layers // 2, num_layers - 3)))


def eagle3_refusals(head: Eagle3Head) -> list[str]:
    """Why `head` would not draft the same through vLLM's and SGLang's loaders: one line per
    difference, empty when `write_eagle3` may write it."""
    config, layer = head.config, head.config.layer
    reasons = []
    if len(config.feature_layers) != 3:
        reasons.append(
            f"feature_layers {list(config.feature_layers)}: vLLM and SGLang build fc over three "
            "captured states"
        )
    if config.norm_before_residual:
        reasons.append(
            "norm_before_residual: SGLang's midlayer takes the hidden input unnormed as its "
            "residual (only vLLM reads that key)"
        )
    if config.fc_bias:
        reasons.append("fc.bias: vLLM builds fc without a bias and has no place to load one")
    if config.own_embedding:
        reasons.append("embed_tokens: SGLang replaces an EAGLE-3 head's table with the target's")
    if layer.attention_bias or layer.attention_out_bias or layer.mlp_bias:
        reasons.append("biases in the midlayer: SGLang's has none")
    if layer.sliding_window is not None or layer.qk_norm or layer.hidden_act != "silu":
        reasons.append("the midlayer is not a plain Llama layer (window, q/k norms, activation)")
    return reasons


def eagle3_config_json(head: Eagle3Head, target_num_layers: int) -> dict:
    """config.json of `head` as the module docstring says."""
    config, layer = head.config, head.config.layer
    values = {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
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
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if layer.rope_scaling is not None:
        values["rope_scaling"] = layer.rope_scaling.to_hf()
    layers = tuple(config.feature_layers)
    if layers != default_capture_layers(target_num_layers):
        values["eagle_aux_hidden_state_layer_ids"] = [k + 1 for k in layers]
        values["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(layers),
            "use_aux_hidden_state": True,
        }
    return values


def eagle3_tensors_of(
    head: Eagle3Head, draft_to_target: torch.Tensor | None, target, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The head's tensors under the names both loaders read, float ones in `dtype` on the CPU."""
    tensors = {}
    for name, param in head.named_parameters():
        stored = f"midlayer.{name.removeprefix('layer.')}" if name.startswith("layer.") else name
        tensors[stored] = param.detach().to("cpu", dtype).contiguous()
    vocab_size = head.config.layer.vocab_size
    ids = torch.arange(vocab_size) if draft_to_target is None else draft_to_target.cpu()
    if "lm_head.weight" not in tensors:  # it scores with the target's LM head (those rows)
        tensors["lm_head.weight"] = (
            (target.lm_head_weight.detach().index_select(0, ids.to(target.lm_head_weight.device)))
            .to("cpu", dtype)
            .contiguous()
        )
    tensors["d2t"] = (ids - torch.arange(ids.shape[0])).to(torch.int64).contiguous()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def write_eagle3(
    head: Eagle3Head,
    draft_to_target: torch.Tensor | None,
    target,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Writes `head` as an EAGLE-3 directory (config.json + model.safetensors) in `out_dir`.

    Args:
        head: an EAGLE-3 head (as `eagle3.load_eagle3_head` loads one, from any style).
        draft_to_target: [V_draft] int64 target id of each draft id, or None (the full
            vocabulary in order).
        target: the `LlamaForCausalLM` it drafts for (its layer count decides whether the
            capture ids are the defaults; its LM head is written when the head shares it).
        out_dir: created if missing.
        dtype: of the written float tensors (float32: the loaded head equals this one).

    Raises:
        ValueError: `head` is not an EAGLE-3 head, or one the two loaders would compute
            otherwise (each difference named).
    """
    if not isinstance(head, Eagle3Head):
        raise ValueError(
            f"this head cannot be written as an EAGLE-3 head (format eagle3): {EAGLE_HEAD_REASON}"
        )
    reasons = eagle3_refusals(head)
    if reasons:
        raise ValueError(
            "this head cannot be written as an EAGLE-3 head (format eagle3) that vLLM and "
            "SGLang both load without changing its drafts: " + "; ".join(reasons)
        )
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = eagle3_config_json(head, target.config.num_hidden_layers)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file(
        eagle3_tensors_of(head, draft_to_target, target, dtype), str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
