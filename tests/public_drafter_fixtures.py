"""Tiny random drafter checkpoints in public formats (EAGLE-1/2, EAGLE-3, Medusa, DFlash, MTP
layers inside a target checkpoint), written with the names their authors' code saves, for the
tiny test target (`models_fixtures`: vocab 97, hidden 64; EAGLE-3 over a deeper one of the same
shape).

Random weights come from seeded generators here (tests only); nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models_fixtures import TINY_CONFIGS, save_hf_model

HIDDEN, VOCAB = 64, 97


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 tensors: norm weights near 1, the rest small (so that a mixed-up norm or
    a missing bias changes the logits)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        tensors[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise
    return tensors


def layer_linear_shapes(
    dim: int, heads: int, kv_heads: int, head_dim: int, inner: int
) -> dict[str, tuple[int, ...]]:
    """The shapes of a Llama decoder layer's seven linear weights, in this order (which
    `random_tensors` draws in): self_attn q, k, v, o, then mlp gate, up, down."""
    return {
        "self_attn.q_proj.weight": (heads * head_dim, dim),
        "self_attn.k_proj.weight": (kv_heads * head_dim, dim),
        "self_attn.v_proj.weight": (kv_heads * head_dim, dim),
        "self_attn.o_proj.weight": (dim, heads * head_dim),
        "mlp.gate_proj.weight": (inner, dim),
        "mlp.up_proj.weight": (inner, dim),
        "mlp.down_proj.weight": (dim, inner),
    }


def write_checkpoint(
    path: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1
) -> Path:
    """config.json and the tensors as one `model.safetensors`, or as `shards` files listed in
    `model.safetensors.index.json` (as `save_pretrained` shards them)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


# EAGLE-1/2: a one-layer Llama config (what SafeAILab's heads ship) and cnets1.py's names.
EAGLE1_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "intermediate_size": 80,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,  # not the target's 1e-5: the feature norm must keep the target's
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "bias": True,
}


def eagle1_tensors(
    seed: int = 5, bias: bool = True, embedding: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE-1/2 head (`fc`, `layers.0.*` without input_layernorm, optional
    `fc.bias` and `embed_tokens.weight`)."""
    heads, kv_heads, head_dim, inter = 4, 2, 16, EAGLE1_CONFIG["intermediate_size"]
    linears = layer_linear_shapes(HIDDEN, heads, kv_heads, head_dim, inter)
    shapes = {
        "fc.weight": (HIDDEN, 2 * HIDDEN),
        **{f"layers.0.{name}": shape for name, shape in linears.items()},
        "layers.0.post_attention_layernorm.weight": (HIDDEN,),
    }
    if bias:
        shapes["fc.bias"] = (HIDDEN,)
    tensors = random_tensors(shapes, seed)
    if embedding is not None:
        tensors["embed_tokens.weight"] = embedding.detach().clone()
    return tensors


def medusa_tensors(
    num_heads: int, num_layers: int, names: str, seed: int = 9, bias: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors of Medusa heads, named as FasterDecoding's `medusa_head` state dict
    ("fasterdecoding": medusa_head.{i}.{j}.linear.*, medusa_head.{i}.{layers}.weight; "legacy":
    the same without the prefix, as medusa_lm_head.* stores it) or as vLLM's (`vllm`:
    blocks.{i}.layers.{j}.*, lm_heads.{i}.weight)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            stem = f"blocks.{i}.layers.{j}" if names == "vllm" else f"{i}.{j}.linear"
            shapes[f"{stem}.weight"] = (HIDDEN, HIDDEN)
            if bias:
                shapes[f"{stem}.bias"] = (HIDDEN,)
        lm = f"lm_heads.{i}" if names == "vllm" else f"{i}.{num_layers}"
        shapes[f"{lm}.weight"] = (VOCAB, HIDDEN)
    tensors = random_tensors(shapes, seed)
    prefix = "medusa_head." if names == "fasterdecoding" else ""
    return {prefix + name: t for name, t in tensors.items()}


def medusa_config(num_heads: int, num_layers: int, names: str) -> dict:
    """FasterDecoding's config.json keys, or vLLM's MedusaConfig's."""
    if names == "vllm":
        return {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "num_heads": num_heads,
            "num_hidden_layers": num_layers,
            "hidden_size": HIDDEN,
            "vocab_size": VOCAB,
            "truncated_vocab_size": VOCAB,
            "medusa_fc_bias": True,
        }
    return {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "tiny-llama",
    }


# EAGLE-3: a tiny target deep enough for the default capture points (the inputs of layers
# 2, N // 2, N - 3 need N >= 7), and heads written in the two config styles in use.
EAGLE3_TARGET_LAYERS = 8
EAGLE3_DRAFT_VOCAB = 40
_EAGLE3_LAYER = {
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "intermediate_size": 80,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
}


def deep_target(seed: int = 0):
    """`models_fixtures.make_hf_model("llama")` with EAGLE3_TARGET_LAYERS layers: a
    `transformers` Llama with seeded random weights (fp32, eval)."""
    import transformers

    from models_fixtures import TINY_CONFIGS

    values = {**TINY_CONFIGS["llama"], "num_hidden_layers": EAGLE3_TARGET_LAYERS}
    config = transformers.LlamaConfig(**values, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


def draft_vocabulary(seed: int = 2, size: int = EAGLE3_DRAFT_VOCAB) -> torch.Tensor:
    """[size] int64 target ids of a reduced draft vocabulary (a seeded subset, ascending, as
    EAGLE-3's training keeps the most frequent tokens in id order)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=generator)[:size].sort().values


def eagle3_tensors(
    prefix: str = "midlayer.",
    seed: int = 11,
    draft_ids: torch.Tensor | None = None,
    fc_bias: bool = False,
    embedding: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE-3 head: `fc` [D, 3D], the midlayer (q/k/v over 2D) under
    `prefix` ("midlayer." as EAGLE / SpecForge save it, "layers.0." as speculators does),
    `norm`, `lm_head` over the draft vocabulary, `d2t` (target id - draft id) and `t2d` (the
    mask of those target ids); `embed_tokens.weight` when `embedding` is given."""
    draft_ids = draft_vocabulary() if draft_ids is None else draft_ids
    heads, kv_heads, head_dim, inter = 4, 2, 16, _EAGLE3_LAYER["intermediate_size"]
    layer = {
        "self_attn.q_proj.weight": (heads * head_dim, 2 * HIDDEN),
        "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * HIDDEN),
        "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, heads * head_dim),
        "mlp.gate_proj.weight": (inter, HIDDEN),
        "mlp.up_proj.weight": (inter, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, inter),
        "input_layernorm.weight": (HIDDEN,),
        "hidden_norm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    shapes = {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        **{prefix + name: shape for name, shape in layer.items()},
        "norm.weight": (HIDDEN,),
        "lm_head.weight": (len(draft_ids), HIDDEN),
    }
    if fc_bias:
        shapes["fc.bias"] = (HIDDEN,)
    tensors = random_tensors(shapes, seed)
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    if embedding is not None:
        tensors["embed_tokens.weight"] = embedding.detach().clone()
    return tensors


def eagle3_config(
    style: str,
    layer_ids: list[int] | None = None,
    draft_vocab_size: int = EAGLE3_DRAFT_VOCAB,
    **extra,
) -> dict:
    """config.json of an EAGLE-3 head.

    "specforge": SpecForge's (SGLang's `LlamaForCausalLMEagle3`): a one-layer Llama config with
    `draft_vocab_size`, the capture ids (if any) in `eagle_config` (SGLang's key: layer k's
    output). "vllm": the same config named as vLLM names the class, the ids at the top level
    (vLLM's key: layer k's input). "speculators": `speculators_model_type: "eagle3"`, the layer
    config under `transformer_layer_config`, the ids at the top level (read as vLLM does).
    `extra` keys are added at the top level."""
    if style == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "draft_vocab_size": draft_vocab_size,
            "norm_before_residual": False,
            "target_hidden_size": None,
            "transformer_layer_config": dict(_EAGLE3_LAYER),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]},
            },
        }
        if layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = layer_ids
        return {**config, **extra}
    architecture = {"specforge": "LlamaForCausalLMEagle3", "vllm": "Eagle3LlamaForCausalLM"}
    config = {
        "architectures": [architecture[style]],
        **_EAGLE3_LAYER,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
    }
    if layer_ids is not None and style == "specforge":
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": layer_ids,
            "use_aux_hidden_state": True,
        }
    elif layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    return {**config, **extra}


# DFlash (z-lab's `DFlashDraftModel`): a Qwen3 target deep enough for two feature layers that
# are not its last, and a two-layer drafter with z-lab's config keys and tensor names.
DFLASH_TARGET_LAYERS = 5
DFLASH_LAYER_IDS = [1, 3]
DFLASH_BLOCK_SIZE = 4  # z-lab's: the anchor and three mask rows (three drafts)
DFLASH_MASK_TOKEN_ID = VOCAB - 1
DFLASH_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "attention_bias": False,
    "vocab_size": VOCAB,
    "num_target_layers": DFLASH_TARGET_LAYERS,
    "block_size": DFLASH_BLOCK_SIZE,
    "dflash_config": {
        "mask_token_id": DFLASH_MASK_TOKEN_ID,
        "target_layer_ids": DFLASH_LAYER_IDS,
    },
}


def dflash_target(seed: int = 0):
    """`models_fixtures.make_hf_model("qwen3_qk_norm")` with DFLASH_TARGET_LAYERS layers: a
    `transformers` Qwen3 with seeded random weights (fp32, eval)."""
    import transformers

    from models_fixtures import TINY_CONFIGS

    values = {**TINY_CONFIGS["qwen3_qk_norm"], "num_hidden_layers": DFLASH_TARGET_LAYERS}
    config = transformers.Qwen3Config(**values, attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


def dflash_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    """z-lab's names: fc, hidden_norm, layers.{i}.* (Qwen3 layers with q_norm / k_norm), norm."""
    cfg = DFLASH_CONFIG
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inner = cfg["intermediate_size"]
    shapes = {
        "fc.weight": (HIDDEN, len(DFLASH_LAYER_IDS) * HIDDEN),
        "hidden_norm.weight": (HIDDEN,),
        "norm.weight": (HIDDEN,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * d, HIDDEN),
            p + "self_attn.k_proj.weight": (kv_heads * d, HIDDEN),
            p + "self_attn.v_proj.weight": (kv_heads * d, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inner, HIDDEN),
            p + "mlp.up_proj.weight": (inner, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, inner),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return random_tensors(shapes, seed)


# Dense MTP layers inside a target checkpoint: MiMo's naming (`model.mtp_layers.{k}`, on the
# tiny Qwen2 with q/k/v biases) and DeepSeek-V3's (`model.layers.{N + k}`, on the tiny Llama).
def mtp_tensors(naming, target_hf, seed=21, num_layers=1):
    """Random tensors of `num_layers` dense MTP layers named as `naming` stores them (q/k/v
    biases where the target's layers have them; DeepSeek-V3's copies of the shared embedding
    and LM head)."""
    cfg = target_hf.config
    dim, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d, inner = dim // heads, cfg.intermediate_size
    layer = {
        **layer_linear_shapes(dim, heads, kv_heads, d, inner),
        "input_layernorm.weight": (dim,),
        "post_attention_layernorm.weight": (dim,),
    }
    if naming == "mimo":
        layer |= {
            f"self_attn.{p}_proj.bias": (n * d,)
            for p, n in zip("qkv", (heads, *[kv_heads] * 2), strict=True)
        }
        layer |= {
            "token_layernorm.weight": (dim,),
            "hidden_layernorm.weight": (dim,),
            "input_proj.weight": (dim, 2 * dim),
            "final_layernorm.weight": (dim,),
        }
    else:
        layer |= {
            "enorm.weight": (dim,),
            "hnorm.weight": (dim,),
            "eh_proj.weight": (dim, 2 * dim),
            "shared_head.norm.weight": (dim,),
        }
    tensors = {}
    for k in range(num_layers):
        prefix = mtp_prefix(naming, k)
        own = random_tensors(layer, seed + k)
        tensors |= {prefix + name: t for name, t in own.items()}
        if naming == "deepseek":
            tensors[prefix + "embed_tokens.weight"] = target_hf.model.embed_tokens.weight.detach()
            tensors[prefix + "shared_head.head.weight"] = target_hf.lm_head.weight.detach()
    return {name: t.detach().clone() for name, t in tensors.items()}


def mtp_prefix(naming, k=0):
    """The tensor-name prefix of MTP layer k as `naming` stores it."""
    if naming == "mimo":
        return f"model.mtp_layers.{k}."
    return f"model.layers.{TINY_CONFIGS['llama']['num_hidden_layers'] + k}."


def write_mtp_target(target_hf, path, naming, tensors, num_layers=1, shards=2):
    """The target's directory with the MTP tensors beside its own (in `shards` files), its
    config.json naming them as MiMo / DeepSeek-V3 do."""
    save_hf_model(target_hf, path)
    config = json.loads((path / "config.json").read_text())
    merged = load_file(str(path / "model.safetensors")) | tensors
    (path / "model.safetensors").unlink()
    if naming == "mimo":
        config |= {"architectures": ["MiMoForCausalLM"], "model_type": "mimo"}
    config["num_nextn_predict_layers"] = num_layers
    return write_checkpoint(path, config, merged, shards=shards)
