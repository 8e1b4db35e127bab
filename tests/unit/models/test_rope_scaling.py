"""RoPE scaling (llama3, yarn, linear, dynamic) against `transformers`, past the original window.

Each tiny config has an original window of 64 positions; prompts reach 512. The cos/sin tables
must equal `transformers`' (YaRN's attention factor m, which we fold into the attention scale,
multiplied back in), and logits of our forward pass over the paged cache must match
`LlamaForCausalLM` on the same random weights within 2e-4 (fp32). Dynamic NTK is compared with
`transformers` decoding token by token (each position is the newest of its call: see
`models/rope.py`), and must not depend on how the prompt is chunked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_fixtures import write_gguf
from models_fixtures import (
    ROPE_SCALING_CONFIGS,
    PagedRunner,
    make_hf_model,
    prompt_tokens,
    save_hf_model,
)
from specdec.models import ModelConfig, RopeScaling, load_model, prompt_logits
from specdec.models.rope import RotaryEmbedding, attention_scale, parse_rope_scaling

pytest.importorskip("transformers", reason="transformers (test extra) is the forward reference")

ATOL = 2e-4
LENGTH = 512


@pytest.fixture(scope="module", params=list(ROPE_SCALING_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, HF model, our loaded model) for each scaling type."""
    hf_model = make_hf_model(request.param)
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))
    model, _, _ = load_model(path)
    return request.param, hf_model, model


def hf_tables(hf_model: Any, positions: torch.Tensor, incremental: bool) -> torch.Tensor:
    """[T, 2, D] transformers' (cos, sin) at `positions`: in one call, or one call per position
    in order (as decoding token by token does)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_model.config)
    x = torch.zeros(1, dtype=torch.float32)
    if not incremental:
        cos, sin = rotary(x, positions[None])
        return torch.stack((cos[0], sin[0]), dim=1)
    rows = [torch.cat(rotary(x, positions[None, t : t + 1]))[:, 0] for t in range(len(positions))]
    return torch.stack(rows)


def hf_incremental_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    """[T, V] logits of `transformers` fed one token per call through its KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    rows = []
    with torch.no_grad():
        for token in tokens:
            out = hf_model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def test_cos_sin_tables_match(checkpoint: Any) -> None:
    name, hf_model, model = checkpoint
    positions = torch.arange(LENGTH)
    config = model.config
    m = config.rope_scaling.attention_factor
    rotary = RotaryEmbedding(config)
    if name == "dynamic":  # one position per call, as transformers is called (cos and sin of
        # one row and of a whole table may differ in the last bit: vectorised loops)
        cos, sin = torch.cat([torch.stack(rotary(positions[t : t + 1])) for t in positions], 1)
    else:
        cos, sin = rotary(positions)
    ours = torch.stack((cos * m, sin * m), dim=1)
    reference = hf_tables(hf_model, positions, incremental=name == "dynamic")
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_logits_match_past_the_original_window(checkpoint: Any) -> None:
    name, hf_model, model = checkpoint
    tokens = prompt_tokens(model.config.vocab_size, [LENGTH], seed=11)[0]
    ours = prompt_logits(model, [tokens], block_size=16)[0]
    if name == "dynamic":
        reference = hf_incremental_logits(hf_model, tokens)
    else:
        with torch.no_grad():
            reference = hf_model(torch.tensor([tokens])).logits[0].float()
    assert (ours - reference).abs().max().item() <= ATOL
    # The scaling matters: plain RoPE of the same theta gives other logits past the window.
    plain = ModelConfig.from_hf_config(
        {k: v for k, v in ROPE_SCALING_CONFIGS[name].items() if k != "rope_parameters"}
    )
    assert plain.rope_scaling is None
    assert not torch.equal(
        RotaryEmbedding(plain)(torch.arange(LENGTH))[0],
        RotaryEmbedding(model.config)(torch.arange(LENGTH))[0],
    )


def test_quantized_dynamic_ntk_rotates_each_position(tmp_path: Path) -> None:
    """A quantized model on the CPU plans its rows (`DecodePlanCPU`, one frequency table for
    every position) unless its RoPE frequencies depend on the position: with dynamic NTK its
    int8 logits stay within the quantization's error of the float model's past the original
    window (measured: 0.26 there, 0.21 inside it; rotated with the base frequencies they were
    5.2 off)."""
    path = save_hf_model(make_hf_model("dynamic"), tmp_path / "dynamic")
    tokens = prompt_tokens(97, [200], seed=11)[0]
    reference = prompt_logits(load_model(path, quantization=None).model, [tokens], 16)[0]
    quantized = load_model(path, quantization="int8").model
    assert quantized.quantization == "int8"
    error = (prompt_logits(quantized, [tokens], block_size=16)[0] - reference).abs()
    assert error[64:].max().item() <= 1.0


def test_chunked_prefill_and_decode_match_one_prefill(checkpoint: Any) -> None:
    """A token's rotation depends on its position only: chunks of 100, then single tokens."""
    _, _, model = checkpoint
    tokens = prompt_tokens(model.config.vocab_size, [300], seed=12)[0]
    whole = prompt_logits(model, [tokens], block_size=16)[0]
    runner = PagedRunner(model, num_blocks=32, block_size=16)
    pieces = [runner.step({0: tokens[s : min(s + 100, 280)]})[0] for s in range(0, 280, 100)]
    pieces += [runner.step({0: [t]})[0] for t in tokens[280:]]
    assert (torch.cat(pieces) - whole).abs().max().item() <= 1e-5


def test_yarn_attention_factor_resolution() -> None:
    assert parse_rope_scaling({"rope_type": "yarn", "factor": 8.0}, 64).attention_factor == (
        pytest.approx(0.1 * math.log(8.0) + 1.0)
    )
    mscale = parse_rope_scaling(
        {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}, 64
    )
    expected = (0.1 * math.log(8.0) + 1.0) / (0.05 * math.log(8.0) + 1.0)
    assert mscale.attention_factor == pytest.approx(expected)
    given = parse_rope_scaling({"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.7}, 64)
    assert given.attention_factor == 0.7
    # No factor: transformers takes max_position_embeddings / original.
    implied = parse_rope_scaling(
        {"rope_type": "yarn", "original_max_position_embeddings": 64}, max_position_embeddings=256
    )
    assert implied.factor == 4.0
    config = ModelConfig.from_hf_config(ROPE_SCALING_CONFIGS["yarn_attention_factor"])
    assert attention_scale(config) == pytest.approx(0.9**2 / math.sqrt(16))


def test_context_length_per_type() -> None:
    lengths = {
        name: ModelConfig.from_hf_config(hf).context_length
        for name, hf in ROPE_SCALING_CONFIGS.items()
    }
    # llama3 declares its extended context; yarn: original x factor; linear, dynamic: x factor.
    assert lengths == {
        "llama3": 512,
        "yarn": 512,
        "yarn_mscale": 512,
        "yarn_attention_factor": 512,
        "linear": 512,
        "dynamic": 512,
    }


def test_round_trip_through_hf_dictionary() -> None:
    for hf in ROPE_SCALING_CONFIGS.values():
        config = ModelConfig.from_hf_config(hf)
        scaling = config.rope_scaling
        assert isinstance(scaling, RopeScaling)
        assert parse_rope_scaling(scaling.to_hf(), config.max_position_embeddings) == scaling


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, "unsupported rope scaling type 'longrope'"),
        ({"type": "su", "factor": 2.0}, "unsupported rope scaling type 'su'"),
        ({"rope_type": "linear"}, "lacks 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "unknown keys \\['beta_fast'\\]"),
        ({"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
    ],
)
def test_bad_scaling_is_refused_at_load(tmp_path: Path, scaling: dict, message: str) -> None:
    hf = {**ROPE_SCALING_CONFIGS["linear"], "rope_parameters": None, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(hf)


def test_unknown_type_refused_by_load_model(tmp_path: Path) -> None:
    hf_model = make_hf_model("linear")
    path = save_hf_model(hf_model, tmp_path / "ckpt")
    config_file = path / "config.json"
    config_file.write_text(config_file.read_text().replace('"linear"', '"longrope"'))
    with pytest.raises(ValueError, match="'longrope'"):
        load_model(path)


def test_gguf_rope_scaling_keys(tmp_path: Path) -> None:
    """GGUF `llama.rope.scaling.*`: linear and yarn are read; the model matches its HF twin."""
    hf_model = make_hf_model("yarn")
    path = write_gguf(
        tmp_path / "yarn.gguf",
        hf_model,
        arch="llama",
        rope_scaling={"type": "yarn", "factor": 8.0, "original_context_length": 64},
    )
    model, config, _ = load_model(path, quantization=None)
    assert (
        config.rope_scaling == ModelConfig.from_hf_config(ROPE_SCALING_CONFIGS["yarn"]).rope_scaling
    )
    tokens = prompt_tokens(config.vocab_size, [200], seed=13)[0]
    with torch.no_grad():
        reference = hf_model(torch.tensor([tokens])).logits[0].float()
    assert (prompt_logits(model, [tokens], block_size=16)[0] - reference).abs().max() <= ATOL

    linear = write_gguf(
        tmp_path / "linear.gguf",
        hf_model,
        arch="llama",
        rope_scaling={"type": "linear", "factor": 4.0},
    )
    assert load_model(linear, quantization=None).config.rope_scaling == RopeScaling("linear", 4.0)
    for bad, message in (
        ({"type": "longrope", "factor": 2.0}, "unsupported GGUF rope scaling 'longrope'"),
        ({"type": "yarn", "factor": 2.0, "yarn_log_multiplier": 0.1}, "yarn_log_multiplier"),
        ({"type": "yarn", "factor": 2.0, "attn_factor": 0.5}, "attn_factor"),
    ):
        bad_path = write_gguf(tmp_path / "bad.gguf", hf_model, arch="llama", rope_scaling=bad)
        with pytest.raises(ValueError, match=message):
            load_model(bad_path, quantization=None)
