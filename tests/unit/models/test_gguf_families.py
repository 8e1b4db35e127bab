"""GGUF files of the families llama.cpp names beyond Llama: qwen3, gemma2, gemma3, olmo2, phi3
(qwen3moe and Mixtral: test_families_moe.py).

Each tiny `transformers` checkpoint is saved as a safetensors directory and written as a GGUF
file the way llama.cpp's converter writes it (`write_gguf`: Q/K not permuted for these
architectures; Gemma's norm weights stored as 1 + w; window, soft-capping and linear RoPE
scaling in the metadata; Phi-3's fused attn_qkv and ffn_up kept whole, its rotated dimensions,
window and LongRoPE factor tensors with their lengths and attention factor). Gemma's
checkpoints here keep what llama.cpp fixes in code (an attention scale of head_dim^-1/2, Gemma
3's every sixth layer full and its sliding layers' base 10000), so the file means what the
directory means: float32 tensors load to the same parameters and logits within 1e-5 (Phi-3's
rank shards too), and Q8_0 tensors, kept quantized, give logits near the float ones; a Gemma 3
file may carry final logit soft-capping, a Phi-3 file an attention factor of its own. Negative
controls read Gemma's norms as stored (without the 1 taken off), drop Gemma 3's final cap, and
swap Phi-3's long and short factors or its gate and up halves; files of other architectures,
and Phi-3 files that lack what LongRoPE needs, are refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_fixtures import write_gguf
from models_fixtures import (
    FAMILY_CONFIGS,
    drop_final_cap,
    make_family_hf_model,
    make_gemma2_hf_model,
    make_gemma3_hf_model,
    make_hf_model,
    max_error,
    prompt_tokens,
    save_hf_model,
)
from specdec.models import ModelConfig, load_model, prompt_logits
from specdec.models.gguf_file import GGUFFile
from specdec.models.layers import RMSNorm
from specdec.models.tensor_parallel import shard_layout, tensor_slice

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the files")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")

ATOL = 1e-5
# Q8_0 kept quantized against the float directory: measured 0.16-0.24 here (Q8_0's rounding
# alone 0.11-0.15, the CPU kernels' bfloat16 activations the rest; logits up to ~5), Phi-3's
# LongRoPE 0.41 (its attention factor m^2 = 2 doubles every score's error); a lost family rule
# (the negative controls) is off by 4-8.
Q8_0_TOL = 0.5
GGML = gguf.GGMLQuantizationType
SLIDING, FULL = "sliding_attention", "full_attention"
# Seven layers: Gemma 3's layers 0-4 and 6 slide (llama.cpp's pattern of six), layer 5 sees all.
_GEMMA3_AS_LLAMA_CPP = {"query_pre_attn_scalar": 16, "num_hidden_layers": 7}
CASES = {
    "qwen3": ("qwen3", lambda: make_hf_model("qwen3_qk_norm")),
    # Norms after each sublayer, whole-projection q/k norms (q/k rows as HF stores them).
    "olmo2": ("olmo2", lambda: make_family_hf_model("olmo2")),
    # Fused attn_qkv and ffn_up (gate rows, then up), q/k rows as HF stores them (NeoX RoPE).
    "phi3": ("phi3", lambda: make_family_hf_model("phi3")),
    # LongRoPE: positions from 16 on (the prompts reach 29) take the long factors; 12 of the 16
    # head dimensions rotate; attention factor sqrt(2).
    "phi3_longrope": (
        "phi3",
        lambda: make_family_hf_model("phi3_longrope", original_max_position_embeddings=16),
    ),
    # A window of 7, kept as `transformers` keeps it (llama.cpp switches Phi-3's window off).
    "phi3_window": ("phi3", lambda: make_family_hf_model("phi3_window")),
    "gemma2": ("gemma2", lambda: make_gemma2_hf_model("gemma2", query_pre_attn_scalar=16)),
    "gemma3": (
        "gemma3",
        lambda: make_gemma3_hf_model("gemma3", **_GEMMA3_AS_LLAMA_CPP, sliding_window_pattern=6),
    ),
    "gemma3_linear": (
        "gemma3",
        lambda: make_gemma3_hf_model(
            "gemma3_linear", **_GEMMA3_AS_LLAMA_CPP, sliding_window_pattern=6
        ),
    ),
    # Final logit soft-capping (metadata `gemma3.final_logit_softcapping`), binding here.
    "gemma3_final_capped": (
        "gemma3",
        lambda: make_gemma3_hf_model(
            "gemma3",
            **_GEMMA3_AS_LLAMA_CPP,
            sliding_window_pattern=6,
            final_logit_softcapping=3.0,
        ),
    ),
}
PROMPTS = prompt_tokens(97, [1, 7, 30, 19], seed=4)  # three of them past the window of 8


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(arch, HF model, safetensors directory, directory for its GGUF files) per case."""
    arch, make = CASES[request.param]
    hf_model = make()
    root = tmp_path_factory.mktemp(request.param)
    return arch, hf_model, save_hf_model(hf_model, root / "hf"), root


def float_logits(path: Path) -> list[torch.Tensor]:
    return prompt_logits(load_model(path).model, PROMPTS, block_size=4)


def in_float32(config: ModelConfig) -> ModelConfig:
    """`config` with LongRoPE's factors rounded to float32, as a GGUF file stores them (RoPE
    divides by them in float32 either way)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.long_factor is None or scaling.short_factor is None:
        return config
    long, short = (
        tuple(torch.tensor(values, dtype=torch.float32).tolist())
        for values in (scaling.long_factor, scaling.short_factor)
    )
    scaling = dataclasses.replace(scaling, long_factor=long, short_factor=short)
    return dataclasses.replace(config, rope_scaling=scaling)


def test_f32_gguf_equals_the_safetensors_directory(checkpoint: Any) -> None:
    """The same config (up to what a GGUF file does not carry: dtype, token ids; its epsilon
    and LongRoPE's factors in float32), the same parameters (Gemma's norms up to float32's
    rounding of 1 + w - 1) and logits within 1e-5."""
    arch, hf_model, directory, root = checkpoint
    file = write_gguf(root / "f32.gguf", hf_model, arch=arch)
    from_gguf, from_dir = load_model(file), load_model(directory)
    if arch == "gemma3":
        assert from_gguf.config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    carried = dataclasses.replace(
        from_gguf.config,
        torch_dtype=from_dir.config.torch_dtype,
        bos_token_id=from_dir.config.bos_token_id,
        eos_token_ids=from_dir.config.eos_token_ids,
        rms_norm_eps=from_dir.config.rms_norm_eps,
    )
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_dir.config.rms_norm_eps, rel=1e-7)
    assert in_float32(carried) == in_float32(from_dir.config)
    if arch == "phi3":
        assert carried.sliding_window == from_dir.config.sliding_window  # 7, or none
        assert carried.partial_rotary_factor == from_dir.config.partial_rotary_factor
    expected = dict(from_dir.model.named_parameters())
    for name, param in from_gguf.model.named_parameters():
        torch.testing.assert_close(param, expected[name], atol=1e-7, rtol=0, msg=name)
    ours = prompt_logits(from_gguf.model, PROMPTS, block_size=4)
    assert max_error(ours, float_logits(directory)) <= ATOL


def test_q8_0_gguf_kept_quantized_is_near_float(checkpoint: Any) -> None:
    """Every projection and the embedding table in Q8_0, kept quantized (quantization="gguf",
    what "auto" picks on the CPU): logits within Q8_0_TOL of the float directory's."""
    arch, hf_model, directory, root = checkpoint
    quantized = {"token_embd.weight": GGML.Q8_0}
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    if arch == "phi3":
        parts = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
    for layer in range(hf_model.config.num_hidden_layers):
        for part in parts:
            quantized[f"blk.{layer}.{part}.weight"] = GGML.Q8_0
    file = write_gguf(root / "q8_0.gguf", hf_model, arch=arch, qtype_of=quantized)
    model = load_model(file, quantization="gguf").model
    assert model.quantization == "gguf"
    assert model.model.layers[0].self_attn.qkv_proj.quantized is not None
    assert model.model.layers[0].mlp.gate_up_proj.quantized is not None
    ours = prompt_logits(model, PROMPTS, block_size=4)
    assert max_error(ours, float_logits(directory)) < Q8_0_TOL


@pytest.mark.parametrize("quantization", [None, "gguf"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_negative_control_norms_as_stored(
    arch: str, quantization: str | None, tmp_path: Path
) -> None:
    """Gemma's norms read as the file stores them (1 + w, the 1 not taken off), beside float32
    or Q8_0 projections: far outside both comparisons' bounds, so either would catch a lost
    shift."""
    _, make = CASES[arch]
    hf_model = make()
    quantized = {} if quantization is None else {"blk.0.ffn_up.weight": GGML.Q8_0}
    file = write_gguf(tmp_path / "model.gguf", hf_model, arch=arch, qtype_of=quantized)
    model = load_model(file, quantization=quantization).model
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight += 1.0
    directory = save_hf_model(hf_model, tmp_path / "hf")
    ours = prompt_logits(model, PROMPTS, block_size=4)
    assert max_error(ours, float_logits(directory)) > 2 * Q8_0_TOL


def _metadata_only(path: Path, arch: str, **floats: float) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(97)
    for key, value in floats.items():
        writer.add_float32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_negative_control_gemma3_final_cap_dropped(tmp_path: Path) -> None:
    """The "gemma3_final_capped" file without its final cap: far from the directory, so the
    f32 comparison above would catch a cap the metadata carries but the reader drops."""
    _, make = CASES["gemma3_final_capped"]
    hf_model = make()
    file = write_gguf(tmp_path / "capped.gguf", hf_model, arch="gemma3")
    assert load_model(file).config.final_logit_softcapping == 3.0
    ours = prompt_logits(drop_final_cap(load_model(file).model), PROMPTS, block_size=4)
    assert max_error(ours, float_logits(save_hf_model(hf_model, tmp_path / "hf"))) > 100 * ATOL


@pytest.mark.parametrize("broken", ["factors_swapped", "gate_up_swapped"])
def test_negative_control_phi3(broken: str, tmp_path: Path) -> None:
    """The "phi3_longrope" file written with its long and short factors swapped, or with the
    halves of every fused ffn_up swapped (up rows first): far outside both comparisons'
    bounds, so either would catch a reader that mixes them up."""
    _, make = CASES["phi3_longrope"]
    hf_model = make()
    directory = save_hf_model(hf_model, tmp_path / "hf")
    rope = hf_model.config.rope_parameters
    with torch.no_grad():
        if broken == "factors_swapped":
            rope["long_factor"], rope["short_factor"] = rope["short_factor"], rope["long_factor"]
        else:
            for layer in hf_model.model.layers:
                gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
                layer.mlp.gate_up_proj.weight.copy_(torch.cat([up, gate]))
    file = write_gguf(tmp_path / "broken.gguf", hf_model, arch="phi3")
    ours = prompt_logits(load_model(file).model, PROMPTS, block_size=4)
    assert max_error(ours, float_logits(directory)) > 2 * Q8_0_TOL


def test_phi3_rank_shards_and_kept_blocks(tmp_path: Path) -> None:
    """Each of two ranks reads its heads' and columns' rows out of the fused tensors (in the
    partial-rotary layout, the unrotated q rows divided by m^2): the directory's shard,
    parameter for parameter; and the Q8_0 blocks kept for q/k/v and gate/up dequantize to the
    float rows read for them, whole and per rank (up to float32's rounding of the row scales'
    m^-2)."""
    _, make = CASES["phi3_longrope"]
    hf_model = make()
    directory = save_hf_model(hf_model, tmp_path / "hf")
    f32 = write_gguf(tmp_path / "f32.gguf", hf_model, arch="phi3")
    config = load_model(f32).config
    for rank in range(2):
        layout = shard_layout(config, rank, 2)
        expected = dict(load_model(directory, shard=layout).model.named_parameters())
        for name, param in load_model(f32, shard=layout).model.named_parameters():
            torch.testing.assert_close(param, expected[name], atol=0, rtol=0, msg=name)
    qtypes = {
        f"blk.{i}.{part}.weight": GGML.Q8_0 for i in range(3) for part in ("attn_qkv", "ffn_up")
    }
    stored = GGUFFile(write_gguf(tmp_path / "q8_0.gguf", hf_model, arch="phi3", qtype_of=qtypes))
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        name = f"model.layers.1.{part}.weight"
        pieces = [tensor_slice(name, config, shard_layout(config, rank, 2)) for rank in (0, 1)]
        for piece in (None, *pieces):
            blocks = stored.read_hf_quantized(name, config, piece)
            assert blocks is not None, name
            floats = stored.read_hf_tensor(name, config, piece)
            torch.testing.assert_close(blocks.dequantize(), floats, atol=1e-6, rtol=1e-6)


def test_phi3_attention_factor_carried_or_refused(tmp_path: Path) -> None:
    """A stored attn_factor other than the converter's rule of the two lengths (1.25 here, the
    rule's sqrt(2)) is the one the model runs with, as llama.cpp runs it: the file equals a
    directory whose rope_scaling says attention_factor 1.25. A LongRoPE file without its
    attn_factor or its original context is refused, naming the key, on one line."""
    rope_scaling = {**FAMILY_CONFIGS["phi3_longrope"]["rope_scaling"], "attention_factor": 1.25}
    hf_model = make_family_hf_model(
        "phi3_longrope", original_max_position_embeddings=16, rope_scaling=rope_scaling
    )
    directory = save_hf_model(hf_model, tmp_path / "hf")
    file = write_gguf(
        tmp_path / "m.gguf", hf_model, arch="phi3", rope_scaling={"attn_factor": 1.25}
    )
    loaded = load_model(file)
    assert loaded.config.rope_scaling.attention_factor == 1.25
    ours = prompt_logits(loaded.model, PROMPTS, block_size=4)
    assert max_error(ours, float_logits(directory)) <= ATOL
    for key in ("attn_factor", "original_context_length"):
        file = write_gguf(
            tmp_path / f"no_{key}.gguf", hf_model, arch="phi3", rope_scaling={key: None}
        )
        with pytest.raises(ValueError, match=f"lacks phi3.rope.scaling.{key}") as info:
            load_model(file)
        assert "\n" not in str(info.value)


def test_refusals_are_one_line_and_named(tmp_path: Path) -> None:
    """Another architecture (the supported ones listed)."""
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'") as info:
        load_model(_metadata_only(tmp_path / "phi2.gguf", "phi2"))
    message = str(info.value)
    assert (
        "supported: llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, olmo2, phi3" in message
        and "\n" not in message
    )
