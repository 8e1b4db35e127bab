"""Mixture-of-experts targets (Mixtral, Qwen3-MoE) against `transformers` on tiny checkpoints.

Each checkpoint is written by `save_pretrained` (per-expert tensors, as the Hub stores them)
and read by `load_model`: Mixtral (6 experts, top-2, renormalised) and Qwen3-MoE (8 experts,
top-2, layer 1 dense through `mlp_only_layers`, `norm_topk_prob` on and off). float32 logits
agree within 1e-4 with `transformers` (batched prefill, decode-path steps); greedy `LLM` equals
`generate` and n-gram speculation equals plain greedy. A prompt's logits alone equal its logits
in a batch bit for bit on the CPU's row plan (the engine's path), with a negative control (the
experts' products unpadded). Negative controls per routing rule (top-k before the softmax,
renormalisation flipped) move the logits far past the tolerance. Refusals name what they
refuse: quantization, CUDA's decode path, shared experts, other routers, more tensor-parallel
ranks than an expert's columns (TP itself: `tests/e2e/test_tensor_parallel_families.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gguf_fixtures import write_gguf
from models_fixtures import (
    GREEDY_PROMPTS,
    MOE_CONFIGS,
    NGRAM_PROMPTS,
    NGRAM_SPEC,
    decode_path_error,
    eager,
    hf_greedy,
    hf_logits,
    llm_greedy,
    make_moe_hf_model,
    prompt_error,
    prompt_tokens,
    save_hf_model,
    speculative_equals_plain,
)
from specdec.engine.llm import LLM
from specdec.models import ModelConfig, load_model, moe, prompt_logits
from specdec.models.fused import silu_mul
from specdec.models.loader import check_moe_quantization, quantize_model
from specdec.models.moe import Expert, SparseMoeBlock, route
from specdec.models.tensor_parallel import shard_layout
from specdec.models.weights import CheckpointError

transformers = pytest.importorskip("transformers", reason="the forward reference")

ATOL = 1e-4
PROMPTS = prompt_tokens(97, [1, 6, 29, 17], seed=2)


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, HF model, checkpoint directory) per tiny MoE config."""
    name = request.param
    hf_model = make_moe_hf_model(name)
    return name, hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp(name))


# --------------------------------------------------------------------------- config
def test_config_reads_moe_options(family: Any) -> None:
    """Experts, top-k, expert width, renormalisation and the sparse layers as config.json says
    (transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`)."""
    name, _, path = family
    config = load_model(path).config
    assert (config.num_experts, config.num_experts_per_tok) == (
        6 if name == "mixtral" else 8,
        2,
    )
    if name == "mixtral":
        assert config.moe_layers == (0, 1, 2) and config.moe_intermediate_size == 96
        assert config.norm_topk_prob and not config.qk_norm
    else:
        assert config.moe_layers == (0, 2) and config.moe_intermediate_size == 48
        assert config.norm_topk_prob == (name == "qwen3_moe") and config.qk_norm
    sparse_step = ModelConfig.from_hf_config(
        {**MOE_CONFIGS["qwen3_moe"], "mlp_only_layers": [], "decoder_sparse_step": 2}
    )
    assert sparse_step.moe_layers == (1,)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size=32"),
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "only the softmax top-k router"),
        ({"num_experts_per_tok": 9}, "9 experts per token of 8"),
    ],
)
def test_config_refusals_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_hf_config({**MOE_CONFIGS["qwen3_moe"], **change})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_stacked_expert_tensors_load(name: str, tmp_path: Path) -> None:
    """A checkpoint of transformers 5's in-memory names (`mlp.experts.gate_up_proj` [E, 2F, D],
    `mlp.experts.down_proj` [E, D, F], Mixtral's router under `mlp`) loads to the same
    logits as the per-expert one; a stack of the wrong expert count is refused by name."""
    import shutil

    from safetensors.torch import save_file

    hf_model = make_moe_hf_model(name)
    per_expert = save_hf_model(hf_model, tmp_path / "per_expert")
    state = {key: value.contiguous() for key, value in hf_model.state_dict().items()}
    assert any(key.endswith("mlp.experts.gate_up_proj") for key in state)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(per_expert / "config.json", stacked / "config.json")
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    expected = prompt_logits(load_model(per_expert).model, PROMPTS)
    for a, b in zip(prompt_logits(load_model(stacked).model, PROMPTS), expected, strict=True):
        assert torch.equal(a, b)
    key = next(key for key in state if key.endswith("mlp.experts.down_proj"))
    state[key] = state[key][:-1].contiguous()
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj holds"):
        load_model(stacked)


# --------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize(
    ("name", "arch", "stacked"),
    [
        ("qwen3_moe", "qwen3moe", True),
        ("qwen3_moe_unnormed", "qwen3moe", True),  # `expert_weights_norm` false in the file
        ("mixtral", "llama", True),
        ("mixtral", "llama", False),  # one tensor per expert, as older Mixtral files
    ],
)
def test_gguf_files_load_as_llama_cpp_writes_them(
    name: str, arch: str, stacked: bool, tmp_path: Path
) -> None:
    """A GGUF file of llama.cpp's layout (`ffn_gate_inp` router, `ffn_{gate,up,down}_exps`
    experts, `expert_count` / `expert_used_count` / `expert_feed_forward_length`) gives
    `transformers`' logits, and the engine decodes it as `transformers` generates; Q8_0 experts
    load as their blocks' values (dequantized), or kept as blocks on the CPU ("auto"). Negative
    control: the router's renormalisation flipped in the file moves the logits far."""
    import gguf

    hf_model = make_moe_hf_model(name)
    file = write_gguf(tmp_path / "m.gguf", hf_model, arch=arch, stacked_experts=stacked)
    loaded = load_model(file)  # F32 tensors: float
    assert (
        loaded.config.moe_layers
        == load_model(save_hf_model(hf_model, tmp_path / "hf")).config.moe_layers
    )
    assert prompt_error(loaded.model, hf_model, PROMPTS) < ATOL
    if name != "qwen3_moe":
        return
    llm = LLM(str(file), max_num_seqs=2)
    prompt = GREEDY_PROMPTS[0]
    (out,) = llm_greedy(llm, [prompt], max_tokens=12)
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    q8 = {  # gate / up rows of 64 (down's rows of 48 are no whole Q8_0 blocks)
        f"blk.{i}.ffn_{p}_exps.weight": gguf.GGMLQuantizationType.Q8_0
        for i in (0, 2)
        for p in ("gate", "up")
    }
    quantized = write_gguf(tmp_path / "q8.gguf", hf_model, arch=arch, qtype_of=q8)
    stored = hf_model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"][5, 48:]  # up
    q8_values = gguf.quants.dequantize(
        gguf.quants.quantize(stored.numpy(), gguf.GGMLQuantizationType.Q8_0),
        gguf.GGMLQuantizationType.Q8_0,
    )
    dequantized = load_model(quantized, quantization=None).model
    loaded_up = dequantized.model.layers[2].mlp.experts[5].up_proj.weight
    assert torch.equal(loaded_up, torch.from_numpy(q8_values))  # the blocks' own values
    assert not torch.equal(loaded_up, stored)
    kept = load_model(quantized, quantization="auto").model  # the CPU's "auto": blocks kept
    assert kept.quantization == "gguf"
    expert = kept.model.layers[2].mlp.experts[5]
    assert expert.up_proj.quantized is not None and expert.down_proj.quantized is None  # F32
    assert kept.model.layers[2].mlp.gate.quantized is None  # the router stays float
    # the kernel's bfloat16 scales: within their rounding of the blocks' values
    assert (expert.up_proj.quantized.dequantize() - loaded_up).abs().max() < 1e-2
    flipped = make_moe_hf_model(name)
    flipped.config.norm_topk_prob = False  # written as expert_weights_norm = false
    wrong = write_gguf(tmp_path / "wrong.gguf", flipped, arch=arch)
    assert prompt_error(load_model(wrong).model, hf_model, PROMPTS) > 100 * ATOL


@pytest.mark.parametrize("source", ["int8", "gguf"])
def test_quantized_experts_on_the_cpu_are_batch_invariant(source: str, tmp_path: Path) -> None:
    """Quantized experts (int8 at load from the HF directory; a GGUF file's Q8_0 experts kept
    as blocks) run each expert's products through the weight-only kernels: a prompt's logits
    alone equal its logits in a batch bit for bit, and n-gram speculation emits plain greedy's
    tokens (the engine on the CPU's decode path)."""
    import gguf

    hf_model = make_moe_hf_model("qwen3_moe")
    if source == "int8":
        path, quantization = save_hf_model(hf_model, tmp_path / "hf"), "int8"
    else:
        q8 = {
            f"blk.{i}.ffn_{p}_exps.weight": gguf.GGMLQuantizationType.Q8_0
            for i in (0, 2)
            for p in ("gate", "up")
        }
        path = write_gguf(tmp_path / "q8.gguf", hf_model, arch="qwen3moe", qtype_of=q8)
        quantization = "auto"
    model = load_model(path, quantization=quantization).model
    assert model.model.layers[0].mlp.experts[0].gate_proj.quantized is not None
    batched = prompt_logits(model, PROMPTS)
    for prompt, rows in zip(PROMPTS, batched, strict=True):
        assert torch.equal(prompt_logits(model, [prompt])[0], rows)
    llm = LLM(str(path), quantization=quantization, speculative_config=NGRAM_SPEC)
    speculative_equals_plain(llm, NGRAM_PROMPTS)


# --------------------------------------------------------------------------- routing
def test_route_is_softmax_then_top_k_with_ties_to_the_lower_id() -> None:
    """The probabilities kept are the softmax over every expert's logit (renormalised or not);
    equal logits go to the lower expert id; top-k then softmax equals softmax, top-k and
    renormalisation (why Mixtral's order cannot be told from renormalisation)."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, -1.0, 2.0, 2.0, 1.0]])
    weights, experts = route(logits, 2, renormalize=False)
    assert experts.tolist() == [[1, 2], [2, 3]]
    assert torch.equal(weights, torch.softmax(logits, -1).gather(1, experts))
    renormed, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(renormed, torch.full((2, 2), 0.5))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 8, generator=generator)
    renormed, experts = route(logits, 2, renormalize=True)
    after = torch.softmax(logits.gather(1, experts), -1)
    assert torch.allclose(renormed, after, atol=1e-6)


def top_k_then_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    values, experts = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, -1), experts


def flipped_renormalisation(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return route(logits, top_k, not renormalize)


@pytest.mark.parametrize(
    "name,breaks",
    [
        ("mixtral", flipped_renormalisation),
        ("qwen3_moe", flipped_renormalisation),
        ("qwen3_moe_unnormed", flipped_renormalisation),
        ("qwen3_moe_unnormed", top_k_then_softmax),
    ],
)
def test_routing_negative_controls_move_the_logits(
    name: str, breaks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each routing rule broken alone moves the logits far past the tolerance (top-k before
    the softmax is tested where it differs: without renormalisation)."""
    hf_model = make_moe_hf_model(name)
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    assert prompt_error(model, hf_model, PROMPTS) <= ATOL
    monkeypatch.setattr(moe, "route", breaks)
    assert prompt_error(model, hf_model, PROMPTS) > 100 * ATOL


# --------------------------------------------------------------------------- parity
def test_prompt_logits_match(family: Any) -> None:
    """One batched prefill of four prompts, on the CPU's row plan and on the eager path."""
    _, hf_model, path = family
    assert prompt_error(load_model(path).model, hf_model, PROMPTS) <= ATOL
    assert prompt_error(eager(load_model(path).model), hf_model, PROMPTS) <= ATOL


def test_decode_path_steps_match(family: Any) -> None:
    """Prefill of 3 tokens, then the decode path (`DecodeMetadata`, the CPU decode plan) in
    steps of 1 to 4 rows per sequence padded to 4."""
    _, hf_model, path = family
    sequences = prompt_tokens(97, [30, 19, 25], seed=6)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    assert decode_path_error(load_model(path).model, references, sequences) <= ATOL


def test_greedy_generation_matches_transformers_generate(family: Any) -> None:
    """24 greedy tokens through `LLM` equal `generate`'s, a prompt holding token id 0 among
    them."""
    _, hf_model, path = family
    outputs = llm_greedy(LLM(str(path), speculative_config=None), GREEDY_PROMPTS)
    for prompt, output in zip(GREEDY_PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)


def test_ngram_speculation_equals_plain_greedy(family: Any) -> None:
    """Greedy with n-gram drafts (K pinned at 3) emits plain greedy's tokens; prompts repeat
    themselves so that n-grams match."""
    _, _, path = family
    speculative_equals_plain(LLM(str(path), speculative_config=NGRAM_SPEC), NGRAM_PROMPTS)


# --------------------------------------------------------------------------- batch invariance
def test_prompt_alone_equals_prompt_in_a_batch(family: Any) -> None:
    """On the CPU's row plan (the engine's path), each prompt's logits alone are the bits of
    its logits in a batch of the others, in either order (its experts see other token counts)."""
    _, _, path = family
    model = load_model(path).model
    alone = [prompt_logits(model, [prompt], block_size=4)[0] for prompt in PROMPTS]
    batched = prompt_logits(model, PROMPTS, block_size=4)
    reversed_batch = prompt_logits(model, PROMPTS[::-1], block_size=4)[::-1]
    for one, two, three in zip(alone, batched, reversed_batch, strict=True):
        assert torch.equal(one, two) and torch.equal(one, three)


def unpadded_expert(self: Expert, x: torch.Tensor) -> torch.Tensor:
    """`Expert.forward` with plain F.linear products (the activation unchanged)."""
    gate_up = torch.cat([F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)], -1)
    return F.linear(silu_mul(gate_up), self.down_proj.weight)


def contiguous_silu_expert(self: Expert, x: torch.Tensor) -> torch.Tensor:
    """`Expert.forward` with SiLU over a contiguous [N, F] (the products unchanged)."""
    gated = F.silu(self.gate_proj.decode(x)) * self.up_proj.decode(x)
    return self.down_proj.decode(gated)


@pytest.mark.parametrize("breaks", [unpadded_expert, contiguous_silu_expert])
def test_expert_rules_negative_controls_are_not_batch_invariant(
    breaks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative controls: with each expert's products a plain F.linear over its gathered tokens
    (not in chunks of `CPU_ROW_CHUNK` rows), or its SiLU over a contiguous [N, F] of F = 44
    (this CPU's vectorised SiLU rounds the elements of a last partial vector otherwise), some
    token's output depends on how many tokens its experts gather; with both rules (the block
    as loaded) none does."""
    generator = torch.Generator().manual_seed(0)
    block = SparseMoeBlock(256, 44, num_experts=4, top_k=2, renormalize=True)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    x = 3.0 * torch.randn(24, 256, generator=generator)

    def rows_differ() -> bool:
        with torch.no_grad():
            alone = torch.cat([block(x[i : i + 1]) for i in range(x.shape[0])])
            return any(not torch.equal(block(x[:count]), alone[:count]) for count in range(2, 25))

    assert not rows_differ()
    monkeypatch.setattr(Expert, "forward", breaks)
    assert rows_differ()


# --------------------------------------------------------------------------- refusals
def test_refusals_are_one_line_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More tensor-parallel ranks than an expert has columns, quantized experts on CUDA (at
    load) and quantizing a loaded model, CUDA's decode path with the grouped kernel switched
    off, a model cut to fewer layers."""
    path = save_hf_model(make_moe_hf_model("qwen3_moe"), tmp_path)
    loaded = load_model(path)
    config = loaded.config
    messages = []
    narrow = dataclasses.replace(config, moe_intermediate_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds the model's MLP") as info:
        shard_layout(narrow, 0, 4)  # more ranks than each expert's columns
    messages.append(str(info.value))
    with pytest.raises(ValueError, match="'int8' is not supported for mixture-of-experts mod"):
        check_moe_quantization(config, "int8", "cuda")  # what `load_model` checks first
    with pytest.raises(ValueError, match="on CUDA yet") as info:
        check_moe_quantization(config, "gguf", torch.device("cuda", 0))
    messages.append(str(info.value))
    check_moe_quantization(config, "int8", "cpu")  # the CPU runs quantized experts
    check_moe_quantization(config, None, "cuda")
    with pytest.raises(ValueError, match="not supported for mixture-of-experts") as info:
        quantize_model(loaded.model, "int8")
    messages.append(str(info.value))
    with pytest.raises(ValueError, match="cannot be cut to fewer layers") as info:
        dataclasses.replace(config, num_hidden_layers=2)
    messages.append(str(info.value))
    assert all("\n" not in message for message in messages)
    monkeypatch.setenv("SPECDEC_MOE_GROUPED_KERNEL", "0")
    assert config.decode_path_reason("cuda").startswith("mixture-of-experts MLP with the grouped")
    assert config.decode_path_reason("cpu") is None
