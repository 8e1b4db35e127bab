"""An EAGLE head made int8 as it is read (`load_eagle_head(int8_linears=True)`: each linear
quantized from the file's tensor, one float weight at a time) against the head loaded in float
and then made int8 (`quantize_head_int8`): the same int8 values, scales and float parameters,
bit for bit, for a file in float16, bfloat16 or float32 and a head in float32 or bfloat16.
Negative controls: quantizing a float16 weight without its cast to a bfloat16 head's dtype
gives other bits (the cast is what keeps them), and one changed weight value is detected."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_fixtures import tiny_target_and_head_fixtures
from specdec.drafters import DrafterSetup
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.drafters.eagle.head import WEIGHTS_FILE, load_eagle_head, quantize_head_int8
from specdec.engine.config import SpeculativeConfig
from specdec.models import load_model
from specdec.models.layers import Linear
from specdec.models.quant import _cpu_int8_available
from specdec.models.quant_formats import quantize

pytestmark = pytest.mark.skipif(not _cpu_int8_available(), reason="no CPU int8 kernel here")

target_dir, head_dir = tiny_target_and_head_fixtures()


@pytest.fixture(scope="module")
def target_config(target_dir):
    return load_model(target_dir).config


def head_in(head_dir, out, dtype: torch.dtype, changed: str | None = None):
    """A copy of the head directory with its float tensors stored in `dtype` (the shipped head
    is float16); `changed`: that weight's first value moved two int8 steps of its row toward
    zero (its int8 value changes)."""
    tensors = load_file(str(head_dir / WEIGHTS_FILE))
    stored = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in tensors.items()
    }
    if changed is not None:
        row = stored[changed][0]
        step = row.float().abs().max() / 127
        row[0] = row[0].float() - torch.sign(row[0].float()) * 2 * step
    out.mkdir()
    (out / "config.json").write_text((head_dir / "config.json").read_text())
    save_file(stored, str(out / WEIGHTS_FILE))
    return out


def bits(tensor: torch.Tensor) -> tuple:
    """A tensor's dtype, shape and bytes (floats compared bit for bit: -0.0, NaN included)."""
    return tensor.dtype, tuple(tensor.shape), tensor.contiguous().view(torch.uint8).tolist()


def head_state(head) -> dict:
    """Every float parameter and every quantized weight's kernel tensors (the fused q/k/v and
    gate/up linears included: attributes, not submodules), as `bits`."""
    state = {name: bits(param) for name, param in head.named_parameters()}
    linears = dict(head.named_modules())
    for block in ("self_attn", "mlp"):
        for fused in ("qkv_proj", "gate_up_proj"):
            linear = getattr(getattr(head.layer, block), fused, None)
            if linear is not None:
                linears[f"layer.{block}.{fused}"] = linear
                state.update(
                    {f"layer.{block}.{fused}.{n}": bits(p) for n, p in linear.named_parameters()}
                )
    for name, module in linears.items():
        quantized = getattr(module, "quantized", None)
        if quantized is not None:
            tensors = quantized._tensors
            state[name] = (quantized.layout, *(bits(tensors[key]) for key in sorted(tensors)))
    return state


def loaded_then_quantized(path, config, dtype):
    head, draft_to_target = load_eagle_head(path, config, dtype, "cpu")
    assert quantize_head_int8(head)
    return head, draft_to_target


@pytest.mark.parametrize("file_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_quantized_as_read_equals_head_quantized_after_load(
    head_dir, target_config, tmp_path, file_dtype, dtype
):
    path = head_in(head_dir, tmp_path / "head", file_dtype)
    streamed, streamed_map = load_eagle_head(path, target_config, dtype, "cpu", int8_linears=True)
    expected, expected_map = loaded_then_quantized(path, target_config, dtype)
    state = head_state(streamed)
    assert state == head_state(expected)
    assert (
        sum(1 for value in state.values() if value[0] == "cpu_int8") >= 6
    )  # fc, in_proj, q/k/v, o, gate/up, down
    for name, module in streamed.named_modules():  # no float linear weight left
        assert not isinstance(module, Linear) or module.weight is None, name
    assert all(param.dtype == dtype for param in streamed.parameters())
    assert (streamed_map is None) == (expected_map is None)
    assert streamed_map is None or torch.equal(streamed_map, expected_map)


def test_one_changed_weight_value_is_detected(head_dir, target_config, tmp_path):
    """Negative control: the comparison above sees one changed value of one weight."""
    path = head_in(head_dir, tmp_path / "head", torch.float16)
    changed = head_in(head_dir, tmp_path / "changed", torch.float16, "layer.mlp.up_proj.weight")
    streamed, _ = load_eagle_head(changed, target_config, torch.float32, "cpu", int8_linears=True)
    expected, _ = loaded_then_quantized(path, target_config, torch.float32)
    differing = [
        name for name, value in head_state(streamed).items() if value != head_state(expected)[name]
    ]
    assert differing == ["layer.mlp.gate_up_proj"]


def test_quantizing_the_file_dtype_without_the_cast_gives_other_bits(head_dir):
    """Negative control: a float16 weight quantized as float16 (upcast exactly inside) differs
    from the bfloat16 weight a bfloat16 head loads: the per-tensor cast to the head's dtype is
    what makes the streamed head equal to the loaded one."""
    weight = load_file(str(head_dir / WEIGHTS_FILE))["layer.mlp.up_proj.weight"].to(torch.float16)
    direct = quantize(weight, "int8")
    cast = quantize(weight.to(torch.bfloat16), "int8")
    assert not (torch.equal(direct.values, cast.values) and torch.equal(direct.scale, cast.scale))


def test_without_the_int8_kernel_the_head_is_loaded_float(
    head_dir, target_config, tmp_path, monkeypatch
):
    """Where `quantize_head_int8` declines, the linears kept in the file's dtype are cast: the
    head loaded in float."""
    path = head_in(head_dir, tmp_path / "head", torch.float16)
    monkeypatch.setattr("specdec.models.quant._cpu_int8_available", lambda: False)
    streamed, _ = load_eagle_head(path, target_config, torch.float32, "cpu", int8_linears=True)
    expected, _ = load_eagle_head(path, target_config, torch.float32, "cpu")
    assert head_state(streamed) == head_state(expected)
    assert all(getattr(m, "quantized", None) is None for m in streamed.modules())


def test_drafter_of_a_quantized_target_holds_the_same_int8_head(target_dir, head_dir, tmp_path):
    """`EagleDrafter.from_config` for a target kept quantized reads its head the streaming way:
    the head of the old path (loaded in the target's dtype, then quantized), fused as the drafter
    fuses it."""
    path = head_in(head_dir, tmp_path / "head", torch.float16)
    target = load_model(target_dir, quantization="int8").model
    assert target.quantization is not None
    spec = SpeculativeConfig(method="eagle", model=str(path))
    setup = DrafterSetup(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32)
    drafter = EagleDrafter.from_config(spec, target, setup)
    expected, _ = loaded_then_quantized(path, target.config, target.dtype)
    expected.layer.self_attn.fuse()
    expected.layer.mlp.fuse()
    assert head_state(drafter.head) == head_state(expected)
