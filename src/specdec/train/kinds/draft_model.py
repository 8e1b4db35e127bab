"""Training a small draft model (vLLM's `draft_model` method): the target's first N layers, its
embeddings, final norm and head, fine-tuned to match the target's next-token distributions
(distillation, Hinton et al. 2015; as a drafter: DistillSpec, Zhou et al. 2024).

Options (`--option key=value`): draft_layers (default max(1, L // 6)), save_dtype.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from specdec.models import LlamaForCausalLM, load_model
from specdec.models.config import ModelConfig
from specdec.models.families import check_llama_layout
from specdec.train.dense import causal_layer
from specdec.train.kind import DrafterKind, TrainBatch, TrainOptions, target_logits


def hf_config_dict(config: ModelConfig) -> dict:
    """A HF `config.json` dictionary that `ModelConfig.from_hf_config` parses back to `config`."""
    if config.rope_freq_factors is not None:
        raise ValueError("a draft with GGUF rope frequency factors cannot be saved as HF config")
    values = {
        "architectures": [config.architecture],
        "model_type": "qwen2"
        if config.architecture == "Qwen2ForCausalLM"
        else "qwen3"
        if config.architecture == "Qwen3ForCausalLM"
        else "mistral"
        if config.architecture == "MistralForCausalLM"
        else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias and config.architecture != "Qwen2ForCausalLM",
        "mlp_bias": config.mlp_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if config.eos_token_ids else None,
    }
    if config.rope_scaling is not None:
        values["rope_scaling"] = config.rope_scaling.to_hf()
    if config.sliding_window is not None:
        values["sliding_window"] = config.sliding_window
    return values


class DraftModelKind(DrafterKind):
    name = "draft_model"
    option_names = frozenset({"draft_layers", "save_dtype"})

    def build(self, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        check_llama_layout(target.config, "training a draft model")
        total = target.config.num_hidden_layers
        layers = options.get("draft_layers", max(1, total // 6), int)
        if not 1 <= layers < total:
            raise ValueError(f"draft_layers must be in [1, {total - 1}], got {layers}")
        config = dataclasses.replace(target.config, num_hidden_layers=layers)
        draft = LlamaForCausalLM(config)
        source = target.state_dict()
        state = {name: source[name].detach().clone().float() for name in draft.state_dict()}
        draft.load_state_dict(state, strict=True, assign=True)
        return draft.to(target.model.embed_tokens.weight.device).requires_grad_(True).train()

    def loss(
        self, draft: nn.Module, target: LlamaForCausalLM, batch: TrainBatch, options: TrainOptions
    ) -> tuple[torch.Tensor, dict[str, float]]:
        device = draft.model.embed_tokens.weight.device
        tokens = batch.token_ids.to(device)
        mask = batch.loss_mask.to(device)
        with torch.no_grad():
            labels = target_logits(target, batch.last_hidden.to(device)).softmax(-1)  # [B, T, V]
        positions = torch.arange(tokens.shape[1], device=device)
        cos, sin = draft.model.rotary_emb(positions)
        hidden = draft.model.embed_tokens(tokens)
        for layer in draft.model.layers:
            hidden, _ = causal_layer(layer, hidden, cos, sin)
        logits = draft.compute_logits(draft.model.norm(hidden))  # [B, T, V]
        ce = -(labels * logits.log_softmax(-1)).sum(-1)
        count = mask.sum().clamp_min(1)
        agree = (logits.argmax(-1) == labels.argmax(-1)) & mask
        return (ce * mask).sum() / count, {"acc1": float(agree.sum() / count)}

    def save(
        self, draft: nn.Module, target: LlamaForCausalLM, out_dir: Path, options: TrainOptions
    ) -> None:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        dtype_name = options.get("save_dtype", "float32")
        dtype = getattr(torch, dtype_name)
        tensors = {
            name: t.detach().to("cpu", dtype).contiguous() for name, t in draft.state_dict().items()
        }
        save_file(tensors, str(out_dir / "model.safetensors"))
        values = {**hf_config_dict(draft.config), "torch_dtype": dtype_name}
        (out_dir / "config.json").write_text(json.dumps(values, indent=2) + "\n")

    def load(self, out_dir: Path, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        device = target.model.embed_tokens.weight.device
        draft = load_model(out_dir, dtype=torch.float32, device=device).model
        return draft.requires_grad_(True).train()
