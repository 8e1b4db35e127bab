"""GGUF loading on tiny files written here: names, Q/K un-permutation, dequantization, tokenizer.

Each tiny file is written from a `transformers` model the way llama.cpp's converter writes it (Q/K
rows permuted for the "llama" architecture), so logits must match `transformers` within 1e-4.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_fixtures import llama_cpp_permute, write_gguf
from models_fixtures import hf_logits, make_hf_model, prompt_tokens
from specdec.models import CheckpointError, load_model, prompt_logits
from specdec.models.gguf_file import GGUFFile, hf_tensor_name, reverse_permute_qk

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) reads GGUF files")
pytest.importorskip("transformers", reason="transformers (test extra) is the forward reference")

ATOL = 1e-4
GGML = gguf.GGMLQuantizationType


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert (
        hf_tensor_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.mark.parametrize(("num_heads", "shape"), [(4, (64, 48)), (2, (32, 48)), (2, (32,))])
def test_reverse_permute_inverts_llama_cpp(num_heads: int, shape: tuple[int, ...]) -> None:
    weight = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    permuted = torch.from_numpy(llama_cpp_permute(weight, num_heads))
    assert not torch.equal(permuted, torch.from_numpy(weight))
    assert torch.equal(reverse_permute_qk(permuted, num_heads), torch.from_numpy(weight))


def _llama3_rope_freqs(hf_model) -> np.ndarray:
    """llama.cpp's converter: Llama 3.1 scaling as per-frequency divisors."""
    params = hf_model.config.rope_parameters
    head_dim = hf_model.config.head_dim
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    old_len = params["original_max_position_embeddings"]
    low_wavelen = old_len / params["low_freq_factor"]
    high_wavelen = old_len / params["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(params["factor"])
        else:
            smooth = (old_len / wavelen - params["low_freq_factor"]) / (
                params["high_freq_factor"] - params["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / params["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize(
    ("name", "arch"),
    [
        ("llama", "llama"),
        ("llama3_rope", "llama"),
        ("smollm2_tied", "llama"),
        ("qwen2_bias", "qwen2"),
        ("qwen3_qk_norm", "qwen3"),
    ],
)
def test_f32_gguf_matches_transformers(tmp_path: Path, name: str, arch: str) -> None:
    hf_model = make_hf_model(name)
    rope_freqs = _llama3_rope_freqs(hf_model) if name == "llama3_rope" else None
    path = write_gguf(tmp_path / "tiny.gguf", hf_model, arch=arch, rope_freqs=rope_freqs)
    model, config, tokenizer = load_model(path)
    assert tokenizer is None
    assert config.tie_word_embeddings == (name == "smollm2_tied")
    assert config.attention_bias == (name == "qwen2_bias")
    assert config.qk_norm == (name == "qwen3_qk_norm")
    assert (config.rope_freq_factors is not None) == (name == "llama3_rope")
    hf_state = hf_model.state_dict()
    for param_name, param in model.named_parameters():
        assert torch.equal(param, hf_state[param_name]), param_name
    prompts = prompt_tokens(config.vocab_size, [7, 30])
    for logits, prompt in zip(prompt_logits(model, prompts, 4), prompts, strict=True):
        assert (logits - hf_logits(hf_model, prompt)).abs().max().item() <= ATOL


def test_quantized_tensors_dequantize_exactly(tmp_path: Path) -> None:
    """Q8_0 / Q4_0 / Q4_1 / F16 tensors come back as gguf's dequantize(quantize(w)), un-permuted."""
    hf_model = make_hf_model("llama")
    qtype_of = {"token_embd.weight": GGML.Q8_0}
    for layer in range(hf_model.config.num_hidden_layers):
        qtype_of |= {
            f"blk.{layer}.attn_q.weight": GGML.Q4_0,
            f"blk.{layer}.attn_k.weight": GGML.Q4_1,
            f"blk.{layer}.attn_v.weight": GGML.Q8_0,
            f"blk.{layer}.attn_output.weight": GGML.F16,
            f"blk.{layer}.ffn_gate.weight": GGML.Q4_1,
            f"blk.{layer}.ffn_up.weight": GGML.F16,
            f"blk.{layer}.ffn_down.weight": GGML.Q4_0,
        }
    path = write_gguf(tmp_path / "q.gguf", hf_model, arch="llama", qtype_of=qtype_of)
    model, _, _ = load_model(path)
    hf_state = hf_model.state_dict()
    name_of = {hf_tensor_name(gguf_name): gguf_name for gguf_name in GGUFFile(path).tensor_names()}
    for param_name, param in model.named_parameters():
        original = hf_state[param_name].numpy()
        qtype = qtype_of.get(name_of[param_name], GGML.F32)
        expected = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        assert torch.equal(param, torch.from_numpy(expected.reshape(original.shape))), param_name
        bits = {GGML.Q4_0: 4, GGML.Q4_1: 4, GGML.Q8_0: 8, GGML.F16: 11, GGML.F32: 24}[qtype]
        # Block quantization error is at most about max|w| / 2^(bits-1) per 32-value block.
        bound = np.abs(original).max() / 2 ** (bits - 1) * 1.01 + 1e-7
        assert np.abs(param.numpy() - original).max() <= bound, param_name


def _train_byte_level_bpe() -> tuple[object, dict]:
    """A byte-level BPE trained here, and its vocabulary as GGUF tokenizer metadata."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café 123 + 4567"] * 30
    backend.train_from_iterator(corpus, trainer)
    model_json = json.loads(backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model_json["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    metadata = {
        "tokens": tokens,
        "token_types": [3 if token.startswith("<|") else 1 for token in tokens],
        "merges": merges,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    }
    return backend, metadata


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_tokenizer_round_trip(tmp_path: Path, add_bos: bool) -> None:
    backend, metadata = _train_byte_level_bpe()
    hf_model = make_hf_model("llama")
    hf_model.resize_token_embeddings(len(metadata["tokens"]))
    metadata["add_bos_token"] = add_bos
    path = write_gguf(tmp_path / "tok.gguf", hf_model, arch="llama", tokenizer=metadata)
    _, config, tokenizer = load_model(path)
    assert tokenizer is not None
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert tokenizer.vocab_size == len(metadata["tokens"]) == config.vocab_size
    for text in ["the lazy fox", "naïve café 1234567", "  spaced\n\nlines\t", "über 🎉"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == backend.encode(text).ids
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(text) == ([1] if add_bos else []) + ids
    special = tokenizer.encode("<|im_start|>the<|im_end|>", add_special_tokens=False)
    assert special[0] == 1 and special[-1] == 2
    assert tokenizer.decode(special) == "the"
    assert tokenizer.decode(special, skip_special_tokens=False) == "<|im_start|>the<|im_end|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>hi<|im_end|>"


def test_gguf_errors(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*llama"):
        load_model(tmp_path / "gpt2.gguf")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match="cannot read GGUF file"):
        load_model(broken)


def test_a_truncated_gguf_is_reported_with_its_byte_counts(tmp_path: Path) -> None:
    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    message = f"the file is {len(data) - 1000:,} bytes; its header declares {len(data):,}"
    with pytest.raises(CheckpointError, match=message):
        load_model(cut)
    cut.write_bytes(data[:40])  # inside the header
    with pytest.raises(CheckpointError, match="the file is 40 bytes and its header does not"):
        load_model(cut)
