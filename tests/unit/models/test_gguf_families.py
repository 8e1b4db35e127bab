"""GGUF files of the families llama.cpp names beyond Llama: qwen3, gemma2, gemma3, olmo2
(qwen3moe and Mixtral: test_families_moe.py).

Each tiny `transformers` checkpoint is saved as a safetensors directory and written as a GGUF
file the way llama.cpp's converter writes it (`write_gguf`: Q/K not permuted for these
architectures; Gemma's norm weights stored as 1 + w; window, soft-capping and linear RoPE
scaling in the metadata). Gemma's checkpoints here keep what llama.cpp fixes in code (an
attention scale of head_dim^-1/2, Gemma 3's every sixth layer full and its sliding layers' base
10000), so the file means what the directory means: float32 tensors load to the same
parameters and logits within 1e-5, and Q8_0 tensors, kept quantized, give logits near the
float ones; a Gemma 3 file may carry final logit soft-capping. Negative controls read Gemma's
norms as stored (without the 1 taken off) and drop Gemma 3's final cap; files of other
architectures are refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from models_fixtures import (
    drop_final_cap,
    make_family_hf_model,
    make_gemma2_hf_model,
    make_gemma3_hf_model,
    make_hf_model,
    max_error,
    prompt_tokens,
    save_hf_model,
    write_gguf,
)
from specdec.models import load_model, prompt_logits
from specdec.models.layers import RMSNorm

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the files")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")

ATOL = 1e-5
# Q8_0 kept quantized against the float directory: measured 0.16-0.23 here (Q8_0's rounding
# alone 0.11-0.15, the CPU kernels' bfloat16 activations the rest; logits up to ~5); a lost
# family rule (the negative control) is off by 4-8.
Q8_0_TOL = 0.5
GGML = gguf.GGMLQuantizationType
SLIDING, FULL = "sliding_attention", "full_attention"
# Seven layers: Gemma 3's layers 0-4 and 6 slide (llama.cpp's pattern of six), layer 5 sees all.
_GEMMA3_AS_LLAMA_CPP = {"query_pre_attn_scalar": 16, "num_hidden_layers": 7}
CASES = {
    "qwen3": ("qwen3", lambda: make_hf_model("qwen3_qk_norm")),
    # Norms after each sublayer, whole-projection q/k norms (q/k rows as HF stores them).
    "olmo2": ("olmo2", lambda: make_family_hf_model("olmo2")),
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


def test_f32_gguf_equals_the_safetensors_directory(checkpoint: Any) -> None:
    """The same config (up to what a GGUF file does not carry: dtype, token ids; its epsilon
    in float32), the same
    parameters (Gemma's norms up to float32's rounding of 1 + w - 1) and logits within 1e-5."""
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
    assert carried == from_dir.config
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
    for layer in range(hf_model.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            quantized[f"blk.{layer}.{part}.weight"] = GGML.Q8_0
    file = write_gguf(root / "q8_0.gguf", hf_model, arch=arch, qtype_of=quantized)
    model = load_model(file, quantization="gguf").model
    assert model.quantization == "gguf"
    assert model.model.layers[0].self_attn.qkv_proj.quantized is not None
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


def test_refusals_are_one_line_and_named(tmp_path: Path) -> None:
    """Another architecture (the supported ones listed)."""
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'") as info:
        load_model(_metadata_only(tmp_path / "phi3.gguf", "phi3"))
    message = str(info.value)
    assert (
        "supported: llama, qwen2, qwen3, qwen3moe, gemma2, gemma3" in message
        and "\n" not in message
    )
