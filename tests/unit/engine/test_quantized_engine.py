"""Exactness within a format: with quantized targets, greedy speculative decoding emits the
tokens greedy plain decoding emits (the verify rows are computed as the decode rows are: the
weight-only kernels' rows and the CPU decode step's attention rows do not depend on the number
of rows), for a batch of requests, with a separate and with a truncated (shared) draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model, write_gguf
from specdec.engine.llm import LLM
from specdec.models.gguf_blocks import decode_blocks
from specdec.models.quant import QuantizedWeight, quant_linear, quantize_int8
from specdec.sampling import SamplingParams

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the files")
pytest.importorskip("transformers", reason="transformers (test extra) builds the tiny models")
GGML = gguf.GGMLQuantizationType


@pytest.mark.parametrize("layout", ["cpu_int4", "cpu_int8"])
def test_kernel_rows_do_not_depend_on_the_batch(layout: str) -> None:
    generator = torch.Generator().manual_seed(0)
    if layout == "cpu_int4":
        raw = gguf.quants.quantize(torch.randn(64, 128, generator=generator).numpy(), GGML.Q4_1)
        weight = QuantizedWeight(decode_blocks(raw, "Q4_1", (64, 128)), "cpu")
    else:
        weight = QuantizedWeight(quantize_int8(torch.randn(64, 128, generator=generator)), "cpu")
    assert weight.layout == layout
    x = torch.randn(40, 128, generator=generator)
    batch = quant_linear(x, weight, kernel_only=True)
    for row in (0, 3, 39):
        alone = quant_linear(x[row : row + 1], weight, kernel_only=True)
        assert torch.equal(alone[0], batch[row])
    # Negative control: the prefill GEMM path (many rows) rounds differently somewhere.
    assert not torch.equal(quant_linear(x, weight), batch)


def _gguf_model(tmp_path: Path) -> str:
    hf_model = make_hf_model("llama")
    names = {}
    for layer in range(hf_model.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            names[f"blk.{layer}.{part}.weight"] = GGML.Q4_1
        names[f"blk.{layer}.ffn_down.weight"] = GGML.Q8_0
    return str(write_gguf(tmp_path / "m.gguf", hf_model, arch="llama", qtype_of=names))


@pytest.mark.parametrize("quantization", ["gguf", "int8", "int4", "fp8"])
def test_greedy_speculation_equals_greedy_plain(tmp_path: Path, quantization: str) -> None:
    if quantization == "gguf":
        path = _gguf_model(tmp_path)
    else:
        path = str(save_hf_model(make_hf_model("llama"), tmp_path / "hf"))
    spec = {"method": "draft_model", "model": "truncated:1", "num_speculative_tokens": 3}
    llm = LLM(path, speculative_config=spec, quantization=quantization, max_model_len=128)
    assert llm.engine.model.quantization == quantization
    prompts = prompt_tokens(97, [6, 11, 3, 8], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, params, speculative={"enabled": False}, use_tqdm=False)
    spec_out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec_out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = [out.spec_decode_stats for out in spec_out]
    assert sum(s["num_accepted_tokens"] for s in stats) > 0  # rounds accepted drafts
    assert sum(s["num_draft_tokens"] - s["num_accepted_tokens"] for s in stats) > 0  # and not
