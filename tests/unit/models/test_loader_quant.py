"""Loading quantized: tiny GGUF files with Q8_0/Q4_0/Q4_1 tensors kept quantized, float
checkpoints quantized at load (int8, int4, fp8), FP8 checkpoints with their own scales, and the
arguments we refuse. Quantized logits are compared with the float model's within each format's
error, and a negative control (another model's logits) must fail the same comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gguf_fixtures import write_gguf
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.config import EngineConfig
from specdec.models import CheckpointError, load_model, prompt_logits
from specdec.models.quant_formats import quantize_fp8

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the files")
pytest.importorskip("transformers", reason="transformers (test extra) builds the tiny models")
GGML = gguf.GGMLQuantizationType


def _qtypes(hf_model, qtype) -> dict:
    """Every matrix but the embedding (97 rows: not whole blocks of packing) in `qtype`."""
    names = {}
    for layer in range(hf_model.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            names[f"blk.{layer}.{part}.weight"] = qtype
        names[f"blk.{layer}.ffn_down.weight"] = GGML.Q8_0
    return names


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen2_bias", "smollm2_tied"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_stays_quantized(tmp_path: Path, arch: str, qtype: str) -> None:
    hf_model = make_hf_model(arch)
    gguf_arch = "qwen2" if arch.startswith("qwen2") else "llama"
    path = write_gguf(
        tmp_path / "m.gguf", hf_model, arch=gguf_arch, qtype_of=_qtypes(hf_model, GGML[qtype])
    )
    floats = load_model(path).model
    quantized = load_model(path, quantization="gguf").model
    assert quantized.quantization == "gguf"
    layer = quantized.model.layers[0]
    assert layer.self_attn.qkv_proj.quantized is not None  # fused, from the GGUF blocks
    assert layer.mlp.gate_up_proj.quantized is not None
    assert layer.mlp.down_proj.quantized is not None
    assert layer.self_attn.q_proj.weight is None  # no float copy
    prompts = prompt_tokens(hf_model.config.vocab_size, [5, 9])
    want = prompt_logits(floats, prompts)
    # The same weights (dequantized exactly) through bfloat16 kernels: bfloat16 activations
    # at every product, through 3 layers of a random model.
    assert _relative_error(prompt_logits(quantized, prompts), want) < 0.06
    other = load_model(
        write_gguf(tmp_path / "o.gguf", make_hf_model(arch, seed=1), arch=gguf_arch)
    ).model
    assert _relative_error(prompt_logits(other, prompts), want) > 0.3  # negative control


def _float_twin(quantized, floats):
    """`floats` with every quantized weight of `quantized` replaced by its dequantization (the
    reference the quantized model must compute)."""
    with torch.no_grad():
        for mine, theirs in zip(quantized.model.layers, floats.model.layers, strict=True):
            for fused, names in (
                (mine.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                (mine.mlp.gate_up_proj, ("gate_proj", "up_proj")),
            ):
                parent = theirs.self_attn if names[0] == "q_proj" else theirs.mlp
                parts = [getattr(parent, name).weight for name in names]
                weight = fused.quantized.dequantize()
                for part, rows in zip(
                    parts, weight.split([p.shape[0] for p in parts]), strict=True
                ):
                    part.copy_(rows)
            for block, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
                source = getattr(getattr(mine, block), name).quantized
                getattr(getattr(theirs, block), name).weight.copy_(source.dequantize())
        floats.lm_head.weight.copy_(quantized.lm_head.quantized.dequantize())
    return floats


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_float_checkpoint_quantized_at_load(tmp_path: Path, quantization: str) -> None:
    """A float checkpoint quantized at load computes its dequantized twin (bfloat16 kernels on
    the CPU for int8/int4, the exact reference for fp8), and stays near the float model."""
    hf_model = make_hf_model("llama")
    path = save_hf_model(hf_model, tmp_path / "hf")
    quantized = load_model(path, quantization=quantization).model
    assert quantized.lm_head.quantized is not None
    prompts = prompt_tokens(hf_model.config.vocab_size, [7, 4])
    got = prompt_logits(quantized, prompts)
    twin = prompt_logits(_float_twin(quantized, load_model(path).model), prompts)
    assert _relative_error(got, twin) < (1e-5 if quantization == "fp8" else 0.06)
    floats = prompt_logits(load_model(path).model, prompts)
    error = _relative_error(got, floats)
    assert error < {"int8": 0.06, "int4": 0.5, "fp8": 0.2}[quantization]
    # Negative control: the twin of another model is far from this one.
    other = load_model(save_hf_model(make_hf_model("llama", seed=1), tmp_path / "o")).model
    assert _relative_error(prompt_logits(other, prompts), twin) > 0.5


def test_fp8_checkpoint_scales_are_used(tmp_path: Path) -> None:
    """An FP8 checkpoint (weights in e4m3 with `weight_scale`, compressed-tensors style) runs
    its own values and scales under "auto"; None dequantizes exactly those."""
    hf_model = make_hf_model("llama")
    path = save_hf_model(hf_model, tmp_path / "fp8")
    state = {name: t.detach().clone().contiguous() for name, t in hf_model.state_dict().items()}
    expected = {}
    for name in list(state):
        if name.endswith("proj.weight"):
            fp8 = quantize_fp8(state[name], per_channel=name.endswith("down_proj.weight"))
            state[name] = fp8.values
            state[name + "_scale"] = fp8.scale[:1] if "down" not in name else fp8.scale[:, None]
            expected[name] = fp8.dequantize()
    for file in path.glob("*.safetensors"):
        file.unlink()
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (path / "config.json").write_text(json.dumps(config))
    auto = load_model(path, quantization="auto").model
    assert auto.quantization == "fp8"
    linear = auto.model.layers[1].mlp.down_proj
    assert torch.equal(
        linear.quantized.dequantize(), expected["model.layers.1.mlp.down_proj.weight"]
    )
    floats = load_model(path).model
    assert torch.equal(
        floats.model.layers[0].self_attn.o_proj.weight,
        expected["model.layers.0.self_attn.o_proj.weight"],
    )


def test_quantization_arguments_are_checked(tmp_path: Path) -> None:
    path = save_hf_model(make_hf_model("llama"), tmp_path / "hf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(path, quantization="gguf")
    with pytest.raises(ValueError, match="awq"):
        load_model(path, quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="gptq")
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig().quantization == "auto"


def test_truncated_gguf_is_one_clear_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", make_hf_model("llama"), arch="llama")
    data = path.read_bytes()
    for cut in (len(data) - 100, 2000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as err:
            load_model(tmp_path / "cut.gguf", quantization="gguf")
        message = str(err.value)
        assert "\n" not in message and ("truncated" in message or "cannot read" in message)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantize_model_equals_quantized_load(tmp_path: Path, quantization: str) -> None:
    """`quantize_model` on a loaded float model gives the model `load_model` quantizes."""
    from specdec.models import quantize_model

    path = save_hf_model(make_hf_model("qwen2_bias"), tmp_path / "hf")
    loaded = load_model(path, quantization=quantization).model
    converted = quantize_model(load_model(path).model, quantization)
    assert converted.model.layers[0].self_attn.q_proj.weight is None
    prompts = prompt_tokens(97, [6])
    assert torch.equal(prompt_logits(converted, prompts)[0], prompt_logits(loaded, prompts)[0])
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(converted, quantization)


def test_a_gguf_file_stays_quantized_on_the_cpu_by_default(tmp_path: Path) -> None:
    """ "auto" keeps a GGUF file's tensors quantized on the CPU (dequantized on CUDA); None
    dequantizes."""
    from specdec.models.loader import resolve_quantization

    path = write_gguf(tmp_path / "m.gguf", make_hf_model("llama"), arch="llama")
    assert resolve_quantization(path, "auto") == "gguf"
    assert resolve_quantization(path, "auto", "cuda") is None
    assert resolve_quantization(path, "gguf") == "gguf"
    assert load_model(path, quantization="auto").model.quantization == "gguf"
    assert load_model(path, quantization=None).model.quantization is None
