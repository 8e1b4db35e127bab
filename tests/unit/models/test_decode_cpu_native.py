"""The CPU decode step's C++ loop (`models/decode_cpu_native.py`) against its twin, the Python
loop of the same ATen operations: logits, K/V caches and captured layers bit for bit, over
prefill chunks (the plan made from `AttentionMetadata`), decode and verify steps with padding
rows and scattered blocks, 4-bit and 8-bit (expanded) int4-layout weights; the built-in model's
seeded generations through `LLM`; and which models it refuses, by name.

Negative control: one norm weight moved by one bfloat16 step (the products' input precision)
changes the C++ loop's logits, so the equality checks see a change that small."""

from __future__ import annotations

import copy

import pytest
import torch

from models_fixtures import PagedRunner, decode_path_step, prompt_tokens, seeded_model
from specdec.models import cpu_extension, decode_cpu_native
from specdec.models.attention import AttentionMetadata
from specdec.models.loader import quantize_model
from specdec.models.quant import QuantizedWeight
from specdec.models.quant_formats import GroupQuantized

extension = cpu_extension.load_extension()
needs_extension = pytest.mark.skipif(
    extension is None, reason="the C++ loop could not be built here (see the log line)"
)


def _eight_bit(weight: torch.Tensor, group: int = 32) -> GroupQuantized:
    """A symmetric 8-bit, group-32 quantization of `weight` (GGUF Q8_0's kind)."""
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group, group)
    scale = grouped.abs().amax(-1).clamp_min(1e-8) / 127
    values = torch.round(grouped / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return GroupQuantized(values.view(rows, cols), scale, None, group, (-128, 127))


def _pair(name: str = "llama") -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same int4 model twice (one layer's down_proj 8-bit, in the expanded int4 layout):
    the first runs the C++ loop, the second the Python loop."""
    float_model = seeded_model(name, "cpu")
    down = float_model.model.layers[1].mlp.down_proj.weight.detach().clone()
    model = quantize_model(float_model, "int4")
    model.fuse_projections()
    eight = QuantizedWeight(_eight_bit(down), "cpu")
    assert eight.layout == "cpu_int4" and eight._meta["source_group"] == 32
    model.model.layers[1].mlp.down_proj.quantized = eight
    twin = copy.deepcopy(model)
    twin.model._native = False
    return model, twin


@needs_extension
def test_prefill_decode_and_verify_steps_equal_the_python_loop() -> None:
    native, python = _pair()
    assert decode_cpu_native.native_reason(native.model) is None
    runners = [PagedRunner(model, num_blocks=40, block_size=4) for model in (native, python)]
    vocab = native.config.vocab_size
    prompts = prompt_tokens(vocab, [9, 14, 5], seed=3)
    stream = prompt_tokens(vocab, [64], seed=4)[0]
    results = []
    for runner in runners:
        logits = [runner.step(dict(enumerate(prompts)))]  # ragged prefill chunks
        logits.append(decode_path_step(runner, {0: stream[:1], 1: stream[1:2], 2: stream[2:3]}, 1))
        # verify rows of 3, 1 and 2 tokens in a 3-row layout: padding rows write nothing
        logits.append(decode_path_step(runner, {0: stream[3:6], 1: stream[6:7], 2: stream[7:9]}, 3))
        logits.append(runner.step({1: stream[9:20], 0: stream[20:21]}))  # a chunk beside a row
        results.append(logits)
    assert native.model._native not in (None, False)  # the C++ loop ran
    for step_native, step_python in zip(*results, strict=True):
        for seq in step_native:
            assert torch.equal(step_native[seq], step_python[seq]), seq
    for cache in ("k_cache", "v_cache"):
        assert torch.equal(getattr(runners[0].kv_cache, cache), getattr(runners[1].kv_cache, cache))


@needs_extension
def test_captured_layers_equal_the_python_loop() -> None:
    native, python = _pair()
    outputs = []
    for model in (native, python):
        runner = PagedRunner(model, num_blocks=20, block_size=4)
        runner.step({0: prompt_tokens(model.config.vocab_size, [7], seed=5)[0]})
        attn = AttentionMetadata.build([3], [10], [runner.tables[0] + [runner.free_blocks[0]]], 4)
        with torch.inference_mode():
            outputs.append(
                model.forward_with_layers(
                    torch.tensor([5, 6, 7]), torch.arange(7, 10), attn, runner.kv_cache, (0, 2, 0)
                )
            )
    (hidden, layers), (hidden_twin, layers_twin) = outputs
    assert torch.equal(hidden, hidden_twin)
    assert len(layers) == 3
    assert all(torch.equal(a, b) for a, b in zip(layers, layers_twin, strict=True))


@needs_extension
def test_negative_control_one_bfloat16_step_in_a_norm_weight_is_seen() -> None:
    native, python = _pair()
    weight = native.model.layers[2].post_attention_layernorm.weight
    weight.data[3] *= 1 + 2**-7
    native.model._native = None  # operands taken anew
    runners = [PagedRunner(model, num_blocks=20, block_size=4) for model in (native, python)]
    prompt = prompt_tokens(native.config.vocab_size, [12], seed=6)[0]
    first, second = (runner.step({0: prompt})[0] for runner in runners)
    assert not torch.equal(first, second)


def test_models_the_loop_cannot_run_are_named() -> None:
    for name, reason in (
        ("qwen2_bias", "biased"),
        ("qwen3_qk_norm", "q/k norms"),
        ("mistral_window", "sliding-window"),
    ):
        model = quantize_model(seeded_model(name, "cpu"), "int4")
        model.fuse_projections()
        assert reason in decode_cpu_native.native_reason(model.model), name
    assert "float products" in decode_cpu_native.native_reason(seeded_model("llama", "cpu").model)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_extension.ENV_SWITCH, "0")
    assert cpu_extension.load_extension.__wrapped__() is None


@needs_extension
def test_builtin_model_generations_equal_the_python_loop() -> None:
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    llm = LLM(speculative_config=None)
    inner = llm.engine.model.model
    prompts = [{"prompt_token_ids": ids} for ids in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11])]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=2)
    native = llm.generate(prompts, params, use_tqdm=False)
    assert inner._native not in (None, False)
    inner._native = False
    python = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(native, python, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert repr(a.outputs[0].logprobs) == repr(b.outputs[0].logprobs)


Q8_SHAPES = [(1, 64, 96, 32), (5, 50, 64, 16), (3, 103, 576, 32), (2, 7, 32, 32)]


@needs_extension
@pytest.mark.parametrize("shape", Q8_SHAPES)
def test_q8_linear_equals_its_twin_and_keeps_rows(shape: tuple[int, int, int, int]) -> None:
    rows, outs, cols, group = shape
    generator = torch.Generator().manual_seed(cols + outs)
    x = torch.randn(rows, cols, generator=generator)
    values = torch.randint(-128, 128, (outs, cols), generator=generator, dtype=torch.int8)
    scale = torch.rand(outs, cols // group, generator=generator) * 0.01
    got = extension.q8_linear(x, values, scale, group)
    assert torch.equal(got, cpu_extension.q8_linear_ref(x, values, scale, group))
    for row in range(rows):  # a row alone gets its bits in the batch
        assert torch.equal(extension.q8_linear(x[row : row + 1], values, scale, group)[0], got[row])
    exact = (
        x.double()
        @ (values.double().view(outs, -1, group) * scale.double()[..., None]).view(outs, cols).T
    )
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@needs_extension
def test_negative_control_q8_lanes_summed_in_another_order_differ() -> None:
    """The twin's lanes summed one after another instead of pairwise: other bits somewhere in
    a few thousand outputs, so the equality above tests the order, not only the value."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(4, 576, generator=generator)
    values = torch.randint(-128, 128, (1024, 576), generator=generator, dtype=torch.int8)
    scale = torch.rand(1024, 18, generator=generator) * 0.01
    got = extension.q8_linear(x, values, scale, 32)
    xs, qs = x.view(4, 1, 18, 2, 16), values.float().view(1, 1024, 18, 2, 16)
    lanes = torch.zeros(4, 1024, 16)
    for g in range(18):
        lanes = (
            lanes
            + (xs[:, :, g, 0] * qs[:, :, g, 0] + xs[:, :, g, 1] * qs[:, :, g, 1])
            * (scale[None, :, g, None])
        )
    sequential = lanes[..., 0]
    for lane in range(1, 16):
        sequential = sequential + lanes[..., lane]
    assert torch.allclose(got, sequential, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, sequential)


@needs_extension
def test_an_8bit_lm_head_takes_q8_linear() -> None:
    """The built-in model's tied Q8_0 head: `QuantizedWeight.matmul` returns the C++ product
    (not PyTorch's int4 kernel over the split nibbles), for prefill and decode rows alike."""
    from specdec.engine.llm import LLM

    head = LLM(speculative_config=None).engine.model.tied_head
    x = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(2))
    source = head.source
    want = extension.q8_linear(x, source.values, source.scale, source.group_size)
    assert torch.equal(head.matmul(x), want)
    assert torch.allclose(head.matmul(x), want)


# (heads, KV heads, head dim, per sequence (keys, rows' key ranges)).
ATTENTION_CASES = {
    "one decode row": (9, 3, 64, [(13, [(0, 13)])]),
    "a prefill chunk and a decode row": (
        4,
        2,
        16,
        [(37, [(0, 35), (0, 36), (0, 37)]), (5, [(0, 5)])],
    ),
    "windows, no GQA": (2, 2, 32, [(40, [(3, 20), (30, 31), (0, 40)])]),
}


@needs_extension
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_row_attention_equals_its_twin_row_by_row(case: str) -> None:
    """`row_attention` (the CPU step's attention, prefill rows included) gives every row the
    bits of `row_attention_ref` over that row's keys: so the same bits alone, in any batch and
    under any chunking of its prompt; and agrees with SDPA to float32 rounding."""
    heads, kv_heads, dim, sequences = ATTENTION_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    num_rows = sum(len(ranges) for _, ranges in sequences)
    query = 3 * torch.randn(num_rows, heads + 2 * kv_heads, dim, generator=generator)[:, :heads]
    scale = dim**-0.5
    seqs, first = [], 0
    for count, ranges in sequences:
        keys = torch.randn(count, kv_heads, dim, generator=generator)
        values = torch.randn(count, kv_heads, dim, generator=generator)
        seqs.append((first, keys, values, [b for b, _ in ranges], [e for _, e in ranges]))
        first += len(ranges)
    out = torch.zeros(num_rows, heads, dim)
    assert cpu_extension.row_attention(query, seqs, scale, out)
    for first, keys, values, begins, ends in seqs:
        for j, (begin, end) in enumerate(zip(begins, ends, strict=True)):
            row = first + j
            twin = cpu_extension.row_attention_ref(
                query[row], keys[begin:end], values[begin:end], scale
            )
            assert torch.equal(out[row], twin), row
            alone = torch.zeros(1, heads, dim)
            one = [(0, keys[begin:end].clone(), values[begin:end].clone(), [0], [end - begin])]
            assert cpu_extension.row_attention(query[row : row + 1], one, scale, alone)
            assert torch.equal(alone[0], out[row]), row
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                query[row][None, :, None],
                keys[begin:end].transpose(0, 1)[None],
                values[begin:end].transpose(0, 1)[None],
                scale=scale,
                enable_gqa=heads != kv_heads,
            )[0, :, 0]
            assert torch.allclose(out[row], sdpa, rtol=1e-5, atol=1e-5)


@needs_extension
def test_negative_control_one_key_moved_slightly_changes_row_attention() -> None:
    """The bit-for-bit checks above see one key component moved by 2^-12 of itself."""
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, 32, generator=generator)
    keys = torch.randn(24, 2, 32, generator=generator)
    values = torch.randn(24, 2, 32, generator=generator)
    moved = keys.clone()
    moved[7, 0, 3] *= 1 + 2.0**-12
    outs = []
    for k in (keys, moved):
        out = torch.zeros(1, 4, 32)
        assert cpu_extension.row_attention(query, [(0, k, values, [0], [24])], 0.2, out)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_exp_nonpositive_is_within_a_few_ulp_of_exp() -> None:
    x = -87.0 * torch.linspace(0.0, 1.0, 100_001)  # float32
    want = x.double().exp()
    got = cpu_extension.exp_nonpositive_ref(x).double()
    assert ((got - want).abs() / want).max().item() < 4 * 2.0**-24
    assert cpu_extension.exp_nonpositive_ref(torch.tensor([0.0])).item() == 1.0
