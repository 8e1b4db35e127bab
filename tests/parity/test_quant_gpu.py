"""Quantized weights on the GPU: the Triton weight-only kernels against `quant_linear_ref`, for
every format (GGUF blocks, int8 per channel, int4 group-wise, FP8 per channel and per tensor),
activation dtype and row count; rows independent of the batch; the dequantization kernel; and
the engine on CUDA (graphs captured) keeping greedy speculative == greedy plain per format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.llm import LLM
from specdec.models.gguf_blocks import BLOCK_SIZES, decode_blocks
from specdec.models.quant import QuantizedWeight, quant_linear, quant_linear_ref
from specdec.models.quant_formats import quantize_fp8, quantize_int4, quantize_int8
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _gguf(type_name: str, rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    values, size = BLOCK_SIZES[type_name]
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [size - 2]}
    for offset in halves[type_name]:
        field = rng.uniform(-0.02, 0.02, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8)
    return decode_blocks(blocks.reshape(-1), type_name, (rows, cols))


def _weights():
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(192, 512, generator=generator) * 0.05
    return {
        **{name: _gguf(name, 192, 512, i) for i, name in enumerate(BLOCK_SIZES)},
        "int8": quantize_int8(dense),
        "int4": quantize_int4(dense, 128),
        "fp8": quantize_fp8(dense),
        "fp8-tensor": quantize_fp8(dense, per_channel=False),
    }


WEIGHTS = _weights()


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 3, 17, 64, 259])
def test_triton_matches_reference(name: str, dtype: torch.dtype, num_rows: int) -> None:
    """Kernel vs x @ W^T with W the exact dequantization rounded to `dtype` (float32
    accumulation both): within a few output ulps, and far from a wrong weight."""
    weight = QuantizedWeight(WEIGHTS[name], CUDA)
    assert weight.layout in ("triton_int", "triton_fp8")
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
    got = quant_linear(x.cuda(), weight).cpu().float()
    exact = weight.dequantize().cpu()
    want = (x.float() @ exact.to(dtype).float().t()).to(dtype).float()
    scale = x.float().abs() @ exact.abs().t()
    assert ((got - want).abs() <= 2.0**-7 * scale + 1e-3).all()
    # The twin rounds the float32 product once; `want` rounds the weight to `dtype` first.
    reference = quant_linear_ref(x.cuda(), weight).cpu().float()
    assert ((reference - want).abs() <= 2.0**-7 * scale + 1e-3).all()
    broken = exact.clone()
    broken[:, :32] *= 2
    wrong = (x.float() @ broken.to(dtype).float().t()).to(dtype).float()
    assert not ((wrong - want).abs() <= 2.0**-7 * scale + 1e-3).all()


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "int8", "fp8"])
@pytest.mark.parametrize("num_rows", [70, 300])
def test_kernel_rows_do_not_depend_on_the_batch(name: str, num_rows: int) -> None:
    """A row's product alone equals the same row among 70 or 300 (until s34 products of 256
    rows or more dequantized the weight for a GEMM, which rounds some rows differently: an
    LM head over a prompt-logprobs step, a step outside the decode path's kernels)."""
    weight = QuantizedWeight(WEIGHTS[name], CUDA)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16).cuda()
    batch = quant_linear(x, weight)
    for row in (0, 5, 69, num_rows - 1):
        assert torch.equal(quant_linear(x[row : row + 1], weight)[0], batch[row]), row


@pytest.mark.parametrize("name", ["Q4_1", "int4", "int8", "fp8"])
def test_zero_rows_give_an_empty_product(name: str) -> None:
    """Zero rows (an eager step's LM head when the step wants no logits): [0, N] back, not
    PyTorch's int4 kernel's CUDA "invalid argument" (s34: an int4 engine failed so)."""
    weight = QuantizedWeight(WEIGHTS[name], CUDA)
    x = torch.empty(0, 512, dtype=torch.bfloat16, device=CUDA)
    out = quant_linear(x, weight)
    torch.cuda.synchronize()
    assert out.shape == (0, 192) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "int4", "fp8"])
def test_dequantize_kernel(name: str) -> None:
    from specdec.models import quant_triton

    weight = QuantizedWeight(WEIGHTS[name], CUDA)
    got = quant_triton.dequantize_triton(weight._tensors, weight._meta, weight.shape, torch.float32)
    # float32 products, possibly fused into one FMA with the zero: within a float32 rounding
    # of the larger of the two terms (the row's largest value bounds both).
    exact = weight.dequantize()
    bound = 2.0**-21 * exact.abs().amax(dim=1, keepdim=True) + 1e-12
    assert ((got - exact).abs() <= bound).all(), float((got - exact).abs().max())
    broken = exact.clone()
    broken[:, :8] += bound[:, :1] * 64
    assert not ((got - broken).abs() <= bound).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K", "int4", "int8"])
def test_four_bit_capable_weights_take_the_int4_kernel(name: str) -> None:
    """GGUF, int4 and int8 weights run through PyTorch's CUDA int4 kernel (8-bit values as the
    CPU's kernel takes them: split nibbles; per-channel scales repeated over groups of 256);
    FP8 stays on the Triton kernel."""
    assert "int4pack" in QuantizedWeight(WEIGHTS[name], CUDA)._tensors
    assert "int4pack" not in QuantizedWeight(WEIGHTS["fp8"], CUDA)._tensors


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_engine_greedy_speculation_equals_plain_on_cuda(tmp_path, quantization: str) -> None:
    """CUDA graphs captured over quantized products: greedy speculative == greedy plain."""
    path = str(save_hf_model(make_hf_model("llama"), tmp_path / "hf"))
    spec = {"method": "draft_model", "model": "truncated:1", "num_speculative_tokens": 3}
    llm = LLM(
        path,
        speculative_config=spec,
        quantization=quantization,
        device="cuda",
        gpu_memory_utilization=0.1,  # a tiny model: leaves the GPU to parallel test workers
    )
    prompts = prompt_tokens(97, [6, 11, 3, 8], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, params, speculative={"enabled": False}, use_tqdm=False)
    spec_out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec_out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
