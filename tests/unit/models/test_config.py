"""ModelConfig parsing: each architecture's quirks, both RoPE spellings, and the errors."""

from __future__ import annotations

import dataclasses

import pytest

from models_fixtures import TINY_CONFIGS
from specdec.models import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling


def test_llama_defaults() -> None:
    config = ModelConfig.from_hf_config(TINY_CONFIGS["llama"])
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 64 // 4
    assert config.num_key_value_heads == 2
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None
    assert not (config.attention_bias or config.attention_out_bias or config.qk_norm)
    assert config.sliding_window is None
    assert config.eos_token_ids == (2,)
    assert config.bos_token_id == 1


def test_architecture_quirks() -> None:
    qwen2 = ModelConfig.from_hf_config(TINY_CONFIGS["qwen2_bias"])
    assert qwen2.attention_bias and not qwen2.attention_out_bias
    qwen3 = ModelConfig.from_hf_config(TINY_CONFIGS["qwen3_qk_norm"])
    assert qwen3.qk_norm and qwen3.head_dim == 24
    mistral = ModelConfig.from_hf_config(TINY_CONFIGS["mistral_window"])
    assert mistral.sliding_window == 7
    tied = ModelConfig.from_hf_config(TINY_CONFIGS["smollm2_tied"])
    assert tied.tie_word_embeddings
    llama_bias = ModelConfig.from_hf_config({**TINY_CONFIGS["llama"], "attention_bias": True})
    assert llama_bias.attention_bias and llama_bias.attention_out_bias


def test_num_key_value_heads_defaults_to_heads() -> None:
    hf_config = {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf_config(hf_config).num_key_value_heads == 4


def test_llama3_rope_both_spellings() -> None:
    expected = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = {**TINY_CONFIGS["llama"], "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    v4b = {**v4, "rope_scaling": {"rope_type": "llama3", **scaling}}
    v5 = {**TINY_CONFIGS["llama"], "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}
    v5["rope_parameters"].update(scaling)
    for hf_config in (v4, v4b, v5):
        config = ModelConfig.from_hf_config(hf_config)
        assert config.rope_scaling == expected
        assert config.rope_theta == 5e5


@pytest.mark.parametrize("rope_type", ["longrope", "proportional", "ntk"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    hf_config = {**TINY_CONFIGS["llama"], "rope_scaling": {"rope_type": rope_type, "factor": 2.0}}
    with pytest.raises(ValueError, match=rf"'{rope_type}'.*supported: llama3, yarn, linear, dyn"):
        ModelConfig.from_hf_config(hf_config)


def test_incomplete_llama3_rope_is_named() -> None:
    hf_config = {**TINY_CONFIGS["llama"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_hf_config(hf_config)


def test_unsupported_architecture_lists_supported() -> None:
    hf_config = {**TINY_CONFIGS["llama"], "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_hf_config(hf_config)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_other_rejections() -> None:
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config({**TINY_CONFIGS["llama"], "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_config({**TINY_CONFIGS["qwen2_bias"], "use_sliding_window": True})
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig.from_hf_config({**TINY_CONFIGS["llama"], "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_config(
            {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "intermediate_size"}
        )


def test_eos_list_and_dtype() -> None:
    hf_config = {**TINY_CONFIGS["llama"], "eos_token_id": [128001, 128009], "dtype": "bfloat16"}
    config = ModelConfig.from_hf_config(hf_config)
    assert config.eos_token_ids == (128001, 128009)
    assert config.torch_dtype == "bfloat16"
    legacy = ModelConfig.from_hf_config({**TINY_CONFIGS["llama"], "torch_dtype": "float16"})
    assert legacy.torch_dtype == "float16"


def test_frozen_and_slotted() -> None:
    config = ModelConfig.from_hf_config(TINY_CONFIGS["llama"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 8  # type: ignore[misc]
    assert not hasattr(config, "__dict__")
