"""Model families on the GPU (issue 37's targets): plain decoding TPOT of random bf16 weights of
real shapes, per byte of weights read, against Llama-3-8B's; a mixture-of-experts shape against
its active-parameter weight-read floor.

- Dense: Llama-3-8B, Qwen3-8B (q/k norms) and Gemma-2-9B (soft-capping, GeGLU, sliding windows,
  a 256,000-token vocabulary): TPOT at batch 1 and 64, and at batch 1 milliseconds per GB of
  weights against Llama-3-8B's (target: within 5%).
- Mixture of experts: Qwen3-30B-A3B (128 experts, 8 a token): TPOT at batch 1 and 64 against
  the floor = bytes a token's step reads (everything but the experts, plus 8 / 128 of them) /
  the device's copy bandwidth measured in the same run (target at batch 1: <= 1.3x); the CPU's
  expert loop (`SPECDEC_MOE_GROUPED_KERNEL=0`) beside the default grouped kernel where
  `--moe-kernels both`.

    python benchmarks/bench_families.py --out DIR [--shapes llama-3-8b,qwen3-8b,gemma-2-9b,
        qwen3-30b-a3b] [--batches 1,64] [--new-tokens 64] [--moe-kernels both]

`--device cpu --shapes tiny` runs every family's code path at toy sizes (a smoke test, not a
figure). Writes DIR/families.json with machine, date and command. Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench_gpu_engine import hf_config, random_prompts
from bench_long_context import copy_bandwidth
from bench_spec_round import decode_phase, make_engine

# The keys Qwen3-8B and Qwen3-30B-A3B share.
QWEN3_COMMON = {
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
SHAPES = {
    # the engine benchmark's Llama-3-8B (bench_gpu_engine.SHAPES), the yardstick per byte
    "llama-3-8b": {**hf_config("llama-3-8b"), "model_type": "llama", "hidden_act": "silu"},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        **QWEN3_COMMON,
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **QWEN3_COMMON,
    },
}
TINY = {  # every family at toy sizes (the CPU smoke test)
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
TINY_FAMILY = {  # and the keys only some families have, at toy sizes
    "gemma-2-9b": {"query_pre_attn_scalar": 16, "sliding_window": 32},
    "qwen3-30b-a3b": {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
}
MOE_ENV = "SPECDEC_MOE_GROUPED_KERNEL"


def log(*args) -> None:
    print(*args, flush=True)


def build(config_dict: dict, device: str):
    """A model of `config_dict` with random weights (normal, std 0.02; norm weights 1; bf16 on
    CUDA, float32 on the CPU)."""
    from specdec.models import LlamaForCausalLM, ModelConfig
    from specdec.models.weights import assign_weights

    config = ModelConfig.from_hf_config(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)

    def read(name: str) -> torch.Tensor:
        out = torch.empty(shapes[name], dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            return out.fill_(1.0)
        return out.normal_(0.0, 0.02, generator=generator)

    assign_weights(model, read, f"random:{config.architecture}", dtype, device)
    return model


def weight_bytes(model, config: dict) -> tuple[int, int]:
    """(all weight bytes, the bytes one token's decode step reads: every weight but the experts,
    plus num_experts_per_tok / num_experts of the experts'; a tied head counted once)."""
    total = expert = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        total += size
        if "experts" in name:
            expert += size
    if not expert:
        return total, total
    share = config["num_experts_per_tok"] / config["num_experts"]
    return total, int(total - expert + expert * share)


def bench_shape(name: str, config: dict, device: str, batches, new_tokens: int) -> dict:
    model = build(config, device)
    total, active = weight_bytes(model, config)
    row: dict = {"weight_gb": total / 1e9, "active_weight_gb": active / 1e9, "tpot_ms": {}}
    for batch in batches:
        prompts = random_prompts(batch, config["vocab_size"], seed=batch, length=64)
        blocks = batch * (-(-(64 + new_tokens + 16) // 16) + 2) + 64
        llm = make_engine(
            model,
            None,
            None,
            device=device,
            max_num_seqs=max(batch, 8),
            max_model_len=512,
            blocks=blocks,
        )
        seconds, _ = decode_phase(llm, prompts, new_tokens, device)
        row["tpot_ms"][batch] = seconds * 1e3
        log(f"[families] {name} b{batch}: {seconds * 1e3:.3f} ms")
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--moe-kernels",
        default="default",
        choices=("default", "both"),
        help="both: the MoE shape also with the grouped expert kernel off (the CPU's loop, "
        "SPECDEC_MOE_GROUPED_KERNEL=0)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = list(SHAPES) if args.shapes == "tiny" else args.shapes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            MOE_ENV: os.environ.get(MOE_ENV),
        }
    }
    bandwidth = copy_bandwidth(args.device)
    result["copy_bandwidth_gb_s"] = None if bandwidth is None else bandwidth / 1e9
    for name in shapes:
        config = SHAPES[name]
        if args.shapes == "tiny":
            config = {**config, **TINY, **TINY_FAMILY.get(name, {})}
        kernels = ["default"]
        if "num_experts" in config and args.moe_kernels == "both":
            kernels.append("loop")
        for kernel in kernels:
            saved = os.environ.get(MOE_ENV)
            if kernel == "loop":
                os.environ[MOE_ENV] = "0"
            key = name if kernel == "default" else f"{name} loop"
            row = bench_shape(name, config, args.device, batches, args.new_tokens)
            if kernel == "loop":
                if saved is None:
                    os.environ.pop(MOE_ENV, None)
                else:
                    os.environ[MOE_ENV] = saved
            if bandwidth is not None and 1 in row["tpot_ms"]:
                floor_ms = row["active_weight_gb"] * 1e9 / bandwidth * 1e3
                row["weight_read_floor_ms"] = floor_ms
                row["b1_over_floor"] = row["tpot_ms"][1] / floor_ms
                row["b1_ms_per_active_gb"] = row["tpot_ms"][1] / row["active_weight_gb"]
            result[key] = row
            (out / "families.json").write_text(json.dumps(result, indent=1))
    base = result.get("llama-3-8b", {}).get("b1_ms_per_active_gb")
    if base:
        for name in shapes:
            row = result.get(name, {})
            if "b1_ms_per_active_gb" in row:
                row["b1_per_gb_vs_llama_3_8b"] = row["b1_ms_per_active_gb"] / base
    (out / "families.json").write_text(json.dumps(result, indent=1))
    log(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
