"""Exactness within a format: with quantized targets, greedy speculative decoding emits the
tokens greedy plain decoding emits (the verify rows are computed as the decode rows are: the
weight-only kernels' rows and the CPU decode step's attention rows do not depend on the number
of rows), for a batch of requests, with a separate and with a truncated (shared) draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_fixtures import write_gguf
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.llm import LLM
from specdec.models.gguf_blocks import decode_blocks
from specdec.models.quant import QuantizedWeight, quant_linear
from specdec.models.quant_formats import quantize_int8
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
    batch = quant_linear(x, weight)
    for row in (0, 3, 39):
        alone = quant_linear(x[row : row + 1], weight)
        assert torch.equal(alone[0], batch[row])
    # Negative control: a dequantized bfloat16 GEMM (what prefill chunks once took) rounds
    # differently somewhere, so a row's value would depend on the path its step takes.
    gemm = torch.nn.functional.linear(x.bfloat16(), weight.dequantize().bfloat16()).float()
    assert not torch.equal(gemm, batch)


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


def test_gguf_rows_do_not_depend_on_what_shares_the_prefill(tmp_path: Path, monkeypatch) -> None:
    """The default load of a GGUF file on the CPU keeps it quantized, and a prompt's final hidden
    states, and its logits taken row by row, are bit-identical alone and inside a batched
    prefill of other prompts (every layer's product takes the weight-only kernel). The LM head
    is compared row by row: this fixture's head is a float product (its GGUF
    leaves output.weight unquantized; quantized, 97 rows would take the dequantizing reference
    layout), and a float GEMM's bits for a row may depend on how many rows it multiplies (on an
    AVX-512 AMD EPYC, 7e-7 apart for a prompt at the end of a 67-row prefill). Negative control:
    with a dequantized bfloat16 GEMM for products of 16 rows or more (what long prefill chunks
    once took), the same comparison fails."""
    from specdec.models import load_model
    from specdec.models.llama import AttentionMetadata

    model = load_model(_gguf_model(tmp_path), quantization="auto").model
    assert model.quantization == "gguf"
    prompts = prompt_tokens(97, [21, 37, 9], seed=5)

    def prefill(batch: list[list[int]]) -> list[torch.Tensor]:
        lengths = [len(p) for p in batch]
        tables, next_block = [], 0
        for length in lengths:
            tables.append(list(range(next_block, next_block + -(-length // 16))))
            next_block += len(tables[-1])
        attn = AttentionMetadata.build(lengths, lengths, tables, 16, model.device)
        ids = torch.cat([torch.tensor(p) for p in batch])
        positions = torch.cat([torch.arange(n) for n in lengths])
        hidden = model(ids, positions, attn, model.allocate_kv_cache(next_block, 16))
        return list(hidden.split(lengths))

    def compare() -> bool:
        alone = [prefill([p])[0] for p in prompts]
        batched = prefill(prompts)
        return all(
            torch.equal(a, b) and torch.equal(model.compute_logits(a), model.compute_logits(b))
            for a, b in zip(alone, batched, strict=True)
        )

    assert compare()
    kernel = QuantizedWeight.matmul

    def rows_dependent(self, x):
        if x.shape[0] >= 16:
            weight = self.dequantize().to(torch.bfloat16)
            return torch.nn.functional.linear(x.to(torch.bfloat16), weight).to(x.dtype)
        return kernel(self, x)

    monkeypatch.setattr(QuantizedWeight, "matmul", rows_dependent)
    # (the decoder layers' C++ loop calls the kernel itself: the Python loop takes the patch)
    monkeypatch.setattr(model.model, "_native", False)
    assert not compare()


def test_gguf_seeded_runs_replay_alone_batched_and_preempted(tmp_path: Path) -> None:
    """Sampled, seeded, with speculation: the default (quantized) GGUF engine emits the same
    tokens for a request alone, in a batch whose prefill chunks mix requests, and after
    preemption."""
    path = _gguf_model(tmp_path)
    spec = {"method": "draft_model", "model": "truncated:1", "num_speculative_tokens": 3}
    prompts = prompt_tokens(97, [21, 37, 9, 17], seed=6)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)

    def run(llm, batch):
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]

    llm = LLM(path, speculative_config=spec, max_model_len=64, max_num_batched_tokens=32)
    assert llm.engine.model.quantization == "gguf"
    batched = run(llm, prompts)
    for i, prompt in enumerate(prompts):
        assert run(llm, [prompt]) == [batched[i]]
    small = LLM(path, speculative_config=spec, max_model_len=64, num_kv_blocks=9, block_size=8)
    assert run(small, prompts) == batched
    assert small.engine.num_preemptions > 0


def test_an_eagle_head_over_a_kept_quantized_target_is_int8_and_exact(tmp_path: Path) -> None:
    """On the CPU a head over a GGUF target kept quantized takes int8 weight-only linears (its
    norms stay float), and speculation stays exact: greedy output equals greedy plain decoding
    with drafts accepted, and with K pinned the device rounds (async scheduling, op by op) emit
    the synchronous path's tokens for seeded sampling (the same drafts from the same head)."""
    from eagle_fixtures import trained_head

    path = _gguf_model(tmp_path)
    head_dir = trained_head(
        save_hf_model(make_hf_model("llama"), tmp_path / "hf"), tmp_path / "head", steps=30
    )
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 2}
    spec["adaptive"] = False
    prompts = prompt_tokens(97, [6, 11, 3, 8], seed=4)
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(
            path, speculative_config=spec, max_model_len=128, async_scheduling=async_scheduling
        )
        head = llm.engine.drafter.head
        assert llm.engine.model.quantization == "gguf"
        for linear in (
            head.fc,
            head.in_proj,
            head.layer.self_attn.o_proj,
            head.layer.mlp.down_proj,
        ):
            assert linear.quantized is not None and linear.quantized.layout == "cpu_int8"
        assert head.norm.weight.dtype == torch.float32
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        plain = llm.generate(prompts, greedy, speculative={"enabled": False}, use_tqdm=False)
        spec_out = llm.generate(prompts, greedy, use_tqdm=False)
        for a, b in zip(plain, spec_out, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert sum(o.spec_decode_stats["num_accepted_tokens"] for o in spec_out) > 0
        sampled = [
            SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=10 + i)
            for i in range(len(prompts))
        ]
        outputs[async_scheduling] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)
        ]
        if async_scheduling:
            assert llm.get_metrics()["loop"]["num_device_rounds"] > 0
    assert outputs[True] == outputs[False]
