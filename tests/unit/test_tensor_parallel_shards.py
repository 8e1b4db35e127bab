"""Tensor-parallel shards of tiny random-weight models (every supported architecture, HF
safetensors and GGUF): the layout rules, each rank's slices read alone equal slices of the whole
tensors (GGUF blocks kept quantized, or dequantized when a boundary cuts a block), and the
logits of TP = 2 (two gloo processes) match TP = 1 within LOGITS_ATOL."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from gguf_fixtures import gguf_tensor_name, write_gguf
from models_fixtures import TINY_CONFIGS, make_hf_model, prompt_tokens, save_hf_model
from specdec.models import load_model, prompt_logits
from specdec.models.config import ModelConfig
from specdec.models.gguf_file import GGUFFile
from specdec.models.loader import read_model_config
from specdec.models.tensor_parallel import (
    TensorSlice,
    check_tensor_parallel_size,
    shard_layout,
    tensor_slice,
)
from tensor_parallel_fixtures import LOGITS_ATOL, sharded_prompt_logits


def _config(**changes) -> ModelConfig:
    base = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    return dataclasses.replace(base, **changes)


def test_layouts_cover_every_head_column_and_id_once():
    for world_size in (1, 2, 4, 8):
        config = _config()
        layouts = [shard_layout(config, rank, world_size) for rank in range(world_size)]
        q_heads = [h for lay in layouts for h in range(*lay.q_heads)]
        assert sorted(q_heads) == list(range(8))
        columns = [c for lay in layouts for c in range(*lay.intermediate)]
        assert columns == list(range(1024))
        ids = [i for lay in layouts for i in range(*lay.vocab)]
        assert ids == list(range(97))
        for lay in layouts:  # each rank's query heads read only the KV heads it holds
            group = 8 // 2
            assert lay.kv_heads == (lay.q_heads[0] // group, (lay.q_heads[1] - 1) // group + 1)
    # 4 ranks over 2 KV heads: each KV head on 2 ranks; MLP split on 256-column boundaries.
    assert [shard_layout(_config(), r, 4).kv_heads for r in range(4)] == [(0, 1)] * 2 + [(1, 2)] * 2
    assert [shard_layout(_config(), r, 4).intermediate for r in range(4)] == [
        (0, 256),
        (256, 512),
        (512, 768),
        (768, 1024),
    ]
    # 3 KV groups over 2 ranks: 1 + 2 groups (uneven, whole groups).
    uneven = _config(num_attention_heads=9, num_key_value_heads=3)
    assert [shard_layout(uneven, r, 2).q_heads for r in range(2)] == [(0, 3), (3, 9)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size"), [(9, 3, 4), (8, 2, 3), (8, 2, 16), (4, 1, 8)]
)
def test_sizes_that_cannot_split_are_one_line_errors(heads, kv_heads, world_size):
    config = _config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={world_size} cannot split") as info:
        check_tensor_parallel_size(config, world_size)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(name, path) of a HF directory per tiny architecture, and a llama GGUF with Q8_0
    weights (o_proj's 64 columns split 32 + 32 on blocks; down_proj's 96 split 48 + 48,
    inside a block: dequantized)."""
    models = []
    for name in TINY_CONFIGS:
        path = tmp_path_factory.mktemp(f"tp-{name}")
        save_hf_model(make_hf_model(name), path)
        models.append((name, str(path)))
    hf_model = make_hf_model("llama")
    qtypes = {
        gguf_tensor_name(n): gguf.GGMLQuantizationType.Q8_0
        for n, t in hf_model.state_dict().items()
        if t.dim() == 2
    }
    path = tmp_path_factory.mktemp("tp-gguf") / "tiny.gguf"
    write_gguf(path, hf_model, arch="llama", qtype_of=qtypes)
    models.append(("llama_gguf_q8_0", str(path)))
    return models


def test_gguf_slices_read_alone_equal_slices_of_the_whole(tiny_models):
    path = dict(tiny_models)["llama_gguf_q8_0"]
    gguf_file = GGUFFile(path)
    config = gguf_file.model_config()
    names = [
        f"model.layers.0.{part}.weight"
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.down_proj",
        )
    ] + ["model.embed_tokens.weight", "lm_head.weight"]
    dequantized = 0
    for rank in range(2):
        layout = shard_layout(config, rank, 2)
        for name in names:
            piece = tensor_slice(name, config, layout)
            whole = piece.take(gguf_file.read_hf_tensor(name, config))
            assert torch.equal(gguf_file.read_hf_tensor(name, config, piece), whole), name
            quantized = gguf_file.read_hf_quantized(name, config, piece)
            if gguf_file.is_block_aligned(name, piece):
                assert torch.equal(quantized.dequantize(), whole), name
            else:  # down_proj's 48-column halves cut Q8_0's 32-value blocks
                assert quantized is None and "down_proj" in name
                dequantized += 1
    assert dequantized == 2
    assert not gguf_file.is_block_aligned(names[5], TensorSlice(1, 16, 48))


def test_an_unaligned_quantized_slice_is_dequantized_with_a_warning(tiny_models):
    path = dict(tiny_models)["llama_gguf_q8_0"]
    layout = shard_layout(read_model_config(path), 1, 2)
    with pytest.warns(UserWarning, match="down_proj.weight: rank 1's columns 48..96 cut Q8_0"):
        model = load_model(path, quantization="gguf", shard=layout).model
    down = model.model.layers[0].mlp.down_proj
    assert down.quantized is None and down.weight.shape == (64, 48)
    assert model.model.layers[0].self_attn.o_proj.quantized is not None


def test_tp2_logits_match_tp1_on_every_architecture(tiny_models):
    prompts = prompt_tokens(97, [5, 9, 14])
    sharded = sharded_prompt_logits([(path, prompts) for _, path in tiny_models])
    for (name, path), logits in zip(tiny_models, sharded, strict=True):
        reference = prompt_logits(load_model(path, quantization=None).model, prompts)
        worst = max(float((a - b).abs().max()) for a, b in zip(logits, reference, strict=True))
        assert worst < LOGITS_ATOL, f"{name}: TP=2 logits differ from TP=1 by {worst}"
