"""Phi-3 and OLMo 2 against `transformers` on tiny random-weight checkpoints.

Each checkpoint is written by `save_pretrained` and read by `load_model`; float32 logits agree
within 1e-4 with `transformers`: whole prompts, paged steps (chunked prefill, decode, verify-like
rows) on the eager path and on the decode path, and greedy generation through `LLM`, plain and
with n-gram speculation. LongRoPE is checked past `original_max_position_embeddings` against
`transformers`' token-by-token decoding (`hf_decode_logits`; the convention is stated in
`models/rope.py`). Negative controls switch a family option off and must move the logits by
far more than the tolerance; refusals are one-line errors that name what is refused.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from models_fixtures import (
    FAMILY_CONFIGS,
    GREEDY_PROMPTS,
    NGRAM_PROMPTS,
    NGRAM_SPEC,
    TINY_CONFIGS,
    PagedRunner,
    hf_decode_logits,
    hf_greedy,
    hf_logits,
    llm_greedy,
    make_family_hf_model,
    max_error,
    paged_steps_error,
    prompt_tokens,
    save_hf_model,
    speculative_equals_plain,
)
from specdec.engine.llm import LLM
from specdec.models import LlamaForCausalLM, ModelConfig, load_model, prompt_logits
from specdec.models.decode_cpu import DecodePlanCPU
from specdec.models.weights import assign_weights
from specdec.runner.model_runner import PagedModelRunner, StepInput

transformers = pytest.importorskip("transformers", reason="the forward reference")

ATOL = 1e-4
# Positions from here on take Phi-3's long factors in "phi3_longrope".
LONG_FROM = FAMILY_CONFIGS["phi3_longrope"]["original_max_position_embeddings"]
DECODE_FAMILIES = [name for name in FAMILY_CONFIGS if name != "phi3_window"]  # no window there


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, HF model, checkpoint directory, our loaded model) per tiny family config."""
    name = request.param
    hf_model = make_family_hf_model(name)
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(name))
    return name, hf_model, path, load_model(path).model


def reference_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    """[T, V] logits `transformers` gives each position while decoding `tokens`: one call over
    the sequence, or token by token once LongRoPE's long factors come in."""
    if len(tokens) > getattr(hf_model.config, "original_max_position_embeddings", len(tokens)):
        return hf_decode_logits(hf_model, tokens)
    return hf_logits(hf_model, tokens)


def test_config_reads_each_family_option() -> None:
    phi3 = ModelConfig.from_hf_config(FAMILY_CONFIGS["phi3_longrope"])
    assert (phi3.norm_placement, phi3.qk_norm, phi3.rotary_dim, phi3.head_dim) == (
        "pre",
        False,
        12,
        16,
    )
    scaling = phi3.rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert scaling.original_max_position_embeddings == LONG_FROM
    # transformers' default attention factor: sqrt(1 + ln(256 / 32) / ln(32))
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    assert phi3.context_length == 256
    olmo2 = ModelConfig.from_hf_config(FAMILY_CONFIGS["olmo2"])
    assert (olmo2.norm_placement, olmo2.qk_norm, olmo2.qk_norm_scope) == ("post", True, "full")
    assert olmo2.norm_weight_in_float32 and olmo2.rotary_dim == olmo2.head_dim
    assert ModelConfig.from_hf_config(FAMILY_CONFIGS["phi3_window"]).sliding_window == 7
    # A window as long as the context (Phi-3.5's 262144 over 131072) never binds: dropped.
    long_window = {**FAMILY_CONFIGS["phi3"], "sliding_window": 256}
    assert ModelConfig.from_hf_config(long_window).sliding_window is None
    # "su" is an older name of longrope (transformers' Phi3Config reads it so).
    su = dict(FAMILY_CONFIGS["phi3_longrope"])
    su["rope_scaling"] = {**su["rope_scaling"], "type": "su"}
    assert ModelConfig.from_hf_config(su).rope_scaling == scaling


def test_config_refusals_are_named() -> None:
    longrope = FAMILY_CONFIGS["phi3_longrope"]["rope_scaling"]
    llama = {**TINY_CONFIGS["llama"], "rope_scaling": longrope}
    with pytest.raises(ValueError, match=r"'longrope'.*supported: llama3, yarn, linear, dyn"):
        ModelConfig.from_hf_config(llama)
    short = {**longrope, "short_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="short_factor has 8 values, expected rotary_dim"):
        ModelConfig.from_hf_config({**FAMILY_CONFIGS["phi3_longrope"], "rope_scaling": short})
    odd = {**FAMILY_CONFIGS["phi3"], "partial_rotary_factor": 0.7}  # 11 of 16 dimensions
    with pytest.raises(ValueError, match="rotates 11 of 16 dimensions"):
        ModelConfig.from_hf_config(odd)


def test_prompt_logits_match(family: Any) -> None:
    """One batched prefill of several prompts (all inside Phi-3's original context)."""
    _, hf_model, _, model = family
    prompts = prompt_tokens(97, [1, 6, 29, 17], seed=2)
    ours = prompt_logits(model, prompts, block_size=4)
    assert max_error(ours, [hf_logits(hf_model, prompt) for prompt in prompts]) <= ATOL


def test_paged_steps_match(family: Any) -> None:
    """Chunked prefill, decode and verify-like steps, three sequences per batch over scattered
    blocks; Phi-3's LongRoPE sequences pass position 32 inside a prefill chunk and a decode."""
    _, hf_model, _, model = family
    sequences = prompt_tokens(97, [45, 9, 50], seed=3)
    references = [reference_logits(hf_model, seq) for seq in sequences]
    schedule = [[11, 4, 13], [18, 5, 20], [1, 0, 1], [4, 0, 3], [1, 0, 1], [10, 0, 12]]
    assert paged_steps_error(model, references, sequences, schedule) <= ATOL


def run_decode_path(path: Path, sequences: list[list[int]], monkeypatch: Any) -> list[Any]:
    """Prefills the sequences' first tokens (eager), then decodes them through the runner's
    decode path in steps of 1 and 4 query rows; returns per step and sequence (its first
    position, [rows, V] logits) and checks that the CPU decode plan ran."""
    built: list[int] = []
    original_build = DecodePlanCPU.build

    def counting_build(*args: Any, **kwargs: Any) -> DecodePlanCPU:
        built.append(1)
        return original_build(*args, **kwargs)

    monkeypatch.setattr(DecodePlanCPU, "build", counting_build)
    runner = PagedModelRunner(
        load_model(path).model,
        num_blocks=48,
        block_size=4,
        max_num_seqs=4,
        max_model_len=64,
        max_query_len=4,
        decode_path=True,
    )
    order = torch.randperm(48, generator=torch.Generator().manual_seed(5)).tolist()
    tables: list[list[int]] = [[] for _ in sequences]
    done = [0] * len(sequences)

    def inputs(counts: list[int], all_rows: bool) -> list[StepInput]:
        step = []
        for b, count in enumerate(counts):
            tokens = sequences[b][done[b] : done[b] + count]
            while len(tables[b]) * 4 < done[b] + count:
                tables[b].append(order.pop())
            step.append(StepInput(tokens, done[b], list(tables[b]), count if all_rows else 1))
        return step

    runner.run(inputs([28, 9, 20], all_rows=False))  # prefill: the eager path
    done = [28, 9, 20]
    results = []
    for counts in ([1, 1, 1], [4, 1, 4], [1, 4, 1], [4, 4, 4], [1, 1, 1]):
        logits = runner.run(inputs(counts, all_rows=True))
        results.append([(done[b], rows.clone()) for b, rows in enumerate(logits)])
        done = [d + n for d, n in zip(done, counts, strict=True)]
    assert len(built) == 5  # every decode step planned its rows on the CPU
    return results


@pytest.mark.parametrize("name", DECODE_FAMILIES)
def test_decode_path_steps_match(name: str, tmp_path: Path, monkeypatch: Any) -> None:
    """The fused decode path (`forward_decode`, the CPU decode plan) over decode and verify
    rows; Phi-3's first sequence passes position 32 in a 4-row verify step."""
    hf_model = make_family_hf_model(name)
    path = save_hf_model(hf_model, tmp_path)
    sequences = prompt_tokens(97, [40, 20, 32], seed=6)
    references = [reference_logits(hf_model, seq) for seq in sequences]
    worst = 0.0
    for step in run_decode_path(path, sequences, monkeypatch):
        for b, (start, logits) in enumerate(step):
            expected = references[b][start : start + logits.shape[0]]
            worst = max(worst, max_error([logits], [expected]))
    assert worst <= ATOL


def test_greedy_generation_matches_transformers_generate(family: Any) -> None:
    """24 greedy tokens through `LLM` equal `generate`'s, a prompt holding token id 0 among
    them (Phi-3's LongRoPE sequences stay within its original context, where `generate` never
    recomputes its cache)."""
    _, hf_model, path, _ = family
    outputs = llm_greedy(LLM(str(path), speculative_config=None), GREEDY_PROMPTS)
    for prompt, output in zip(GREEDY_PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)


def test_greedy_past_the_longrope_switch_matches_transformers_decoding(tmp_path: Path) -> None:
    """Past position 32 the tokens are those of `transformers` decoding greedily token by token
    with its cache (`generate` instead recomputes every earlier token with the long factors
    when the sequence first passes the original context: see `models/rope.py`)."""
    from transformers import DynamicCache

    hf_model = make_family_hf_model("phi3_longrope")
    path = save_hf_model(hf_model, tmp_path)
    prompt = prompt_tokens(97, [20], seed=8)[0]
    tokens, cache = list(prompt), DynamicCache(config=hf_model.config)
    with torch.no_grad():
        for position in range(len(prompt) + 23):
            step = torch.tensor([[tokens[position]]])
            out = hf_model(step, position_ids=torch.tensor([[position]]), cache=cache)
            if position + 1 >= len(prompt):
                tokens.append(int(out.logits[0, -1].argmax()))
    assert len(prompt) + 24 > LONG_FROM + 8
    output = llm_greedy(LLM(str(path), speculative_config=None), [prompt])[0]
    assert list(output.outputs[0].token_ids) == tokens[len(prompt) :]


def test_ngram_speculation_equals_plain_greedy(family: Any) -> None:
    """Greedy with n-gram drafts (K pinned at 3, so that drafting runs on a busy machine)
    emits plain greedy's tokens; prompts repeat themselves so that n-grams match, and one
    passes Phi-3's long-factor switch."""
    _, _, path, _ = family
    speculative_equals_plain(LLM(str(path), speculative_config=NGRAM_SPEC), NGRAM_PROMPTS)


# --------------------------------------------------------------------------- negative controls
def model_from_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assign_weights(model, state.get, "control", torch.float32, "cpu")
    return model


def olmo2_state(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    model, config, _ = load_model(path)
    return config, {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_negative_control_olmo2_with_llama_norm_placement(tmp_path: Path) -> None:
    """OLMo 2's weights under Llama's placement (its two norms moved before attention and MLP)
    are far from `transformers`: the parity tests above would catch a lost placement."""
    hf_model = make_family_hf_model("olmo2")
    config, state = olmo2_state(save_hf_model(hf_model, tmp_path))
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        state[prefix + "input_layernorm.weight"] = state.pop(
            prefix + "post_attention_layernorm.weight"
        )
        state[prefix + "post_attention_layernorm.weight"] = state.pop(
            prefix + "post_feedforward_layernorm.weight"
        )
    pre = model_from_state(dataclasses.replace(config, norm_placement="pre"), state)
    prompt = prompt_tokens(97, [17], seed=2)[0]
    error = (prompt_logits(pre, [prompt])[0] - hf_logits(hf_model, prompt)).abs().max().item()
    assert error > 100 * ATOL


def test_negative_control_olmo2_with_per_head_qk_norm(tmp_path: Path) -> None:
    """q/k norms over each head (Qwen3's scope, the first head's weights for every head)
    instead of the whole projection: far from `transformers`."""
    hf_model = make_family_hf_model("olmo2")
    config, state = olmo2_state(save_hf_model(hf_model, tmp_path))
    for name in [name for name in state if name.endswith(("q_norm.weight", "k_norm.weight"))]:
        state[name] = state[name][: config.head_dim]
    per_head = model_from_state(dataclasses.replace(config, qk_norm_scope="head"), state)
    prompt = prompt_tokens(97, [17], seed=2)[0]
    error = (prompt_logits(per_head, [prompt])[0] - hf_logits(hf_model, prompt)).abs().max()
    assert error.item() > 100 * ATOL


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, torch.Tensor, list]:
    """The LongRoPE checkpoint, a 48-token sequence and `transformers`' decoding logits."""
    hf_model = make_family_hf_model("phi3_longrope")
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("longrope"))
    tokens = prompt_tokens(97, [48], seed=10)[0]
    return hf_model, path, hf_decode_logits(hf_model, tokens), tokens


def decode_errors(model: LlamaForCausalLM, tokens: list[int], reference: torch.Tensor) -> Any:
    """[T] max |ours - reference| per position, decoding one token per step."""
    runner = PagedRunner(model, num_blocks=16, block_size=4)
    rows = [runner.step({0: [token]})[0][-1] for token in tokens]
    return (torch.stack(rows) - reference).abs().amax(dim=-1)


def test_longrope_switches_to_the_long_factors_at_the_original_context(longrope: Any) -> None:
    """Ours decodes within the tolerance everywhere. Negative controls: without the long
    factors the positions from 32 on are far off (those before stay exact: the switch is where
    `transformers` puts it); with the long factors from position 0 (vLLM's choice whenever
    max_model_len exceeds the original context) every position is off."""
    _, path, reference, tokens = longrope
    assert decode_errors(load_model(path).model, tokens, reference).max() <= ATOL
    short_only = load_model(path).model
    rotary = short_only.model.rotary_emb
    rotary.long_inv_freq = rotary.inv_freq
    errors = decode_errors(short_only, tokens, reference)
    assert errors[:LONG_FROM].max() <= ATOL
    assert errors[LONG_FROM:].min() > 100 * ATOL
    long_only = load_model(path).model
    long_only.model.rotary_emb.long_from = 0
    assert decode_errors(long_only, tokens, reference)[1:].min() > 100 * ATOL


def test_negative_control_partial_rotary_without_the_layout(
    longrope: Any, monkeypatch: Any
) -> None:
    """q/k rows kept in the checkpoint's order (rotating dimensions 0..5 with 6..11 instead of
    transformers' pairs, and m^2 over the unrotated ones): far from `transformers`."""
    from specdec.models import hf_tensors

    _, path, reference, tokens = longrope
    monkeypatch.setattr(hf_tensors, "_partial_rotary_rows", lambda config, read: read)
    errors = decode_errors(load_model(path).model, tokens, reference)
    assert errors[1:].min() > 100 * ATOL


def test_negative_control_attention_factor_over_every_q_dimension(
    longrope: Any, monkeypatch: Any
) -> None:
    """The layout without dividing the unrotated q rows by m^2 (so that the scale's m^2 weighs
    them too, where `transformers` scales the rotated dimensions alone): far off wherever
    there is more than one key to weigh."""
    from specdec.models import hf_tensors

    _, path, reference, tokens = longrope
    layout_rows = hf_tensors._partial_rotary_rows

    def without_m(config: ModelConfig, read: Any) -> Any:
        scaling = dataclasses.replace(config.rope_scaling, attention_factor=1.0)
        return layout_rows(dataclasses.replace(config, rope_scaling=scaling), read)

    monkeypatch.setattr(hf_tensors, "_partial_rotary_rows", without_m)
    errors = decode_errors(load_model(path).model, tokens, reference)
    assert errors[0] <= ATOL  # one key: its weight is 1 whatever the scores
    assert errors[1:].min() > 100 * ATOL


# --------------------------------------------------------------------------- other paths
def test_olmo2_rms_norm_numerics_are_transformers_in_bfloat16() -> None:
    """OLMo 2's norms multiply by the weight before casting back: bit for bit `transformers`'
    in bfloat16 (Llama's order, the negative control, rounds differently)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from specdec.models.layers import RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator).bfloat16()
    weight = (1 + 0.2 * torch.randn(256, generator=generator)).bfloat16()
    reference = Olmo2RMSNorm(256, eps=1e-5).bfloat16()
    ours, llama_order = RMSNorm(256, 1e-5, weight_in_float32=True), RMSNorm(256, 1e-5)
    for norm in (reference, ours, llama_order):
        norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    with torch.no_grad():
        assert torch.equal(ours(x), reference(x))
        assert not torch.equal(llama_order(x), reference(x))


@pytest.mark.parametrize("name", ["phi3_longrope", "olmo2"])
def test_int8_at_load_runs_both_paths(name: str, tmp_path: Path) -> None:
    """int8 weights at load (Phi-3's q/k/v and gate/up split from its fused tensors, then
    packed together again): prompt logits near the float model's on the eager and the decode
    path, and greedy n-gram speculation equal to plain greedy."""
    path = save_hf_model(make_family_hf_model(name), tmp_path)
    model = load_model(path, quantization="int8").model
    assert model.model.layers[0].self_attn.qkv_proj.quantized is not None
    prompts = prompt_tokens(97, [40, 9], seed=11)
    floats = prompt_logits(load_model(path).model, prompts)
    # int8 weights and the CPU kernels' bfloat16 rounding: 0.1-0.3 here as for the tiny Llama
    # (logits up to ~5; a wrong split or layout is off by the logits' scale).
    assert max_error(prompt_logits(model, prompts), floats) < 0.5
    llm = LLM(str(path), speculative_config=NGRAM_SPEC, quantization="int8")
    speculative_equals_plain(llm, NGRAM_PROMPTS[::2])


def test_phi3_tensor_parallel_matches_one_rank(tmp_path: Path) -> None:
    """Two gloo ranks, each reading its heads' rows out of Phi-3's fused tensors (in the
    partial-rotary layout), give the one-rank logits up to the reduction order."""
    from tensor_parallel_fixtures import LOGITS_ATOL, sharded_prompt_logits

    path = save_hf_model(make_family_hf_model("phi3_longrope"), tmp_path)
    prompts = prompt_tokens(97, [40, 9], seed=12)
    sharded = sharded_prompt_logits([(str(path), prompts)])[0]
    assert max_error(sharded, prompt_logits(load_model(path).model, prompts)) <= LOGITS_ATOL


def test_refusals_are_one_line_and_named(tmp_path: Path) -> None:
    """GGUF files of either family without metadata. (A windowed Phi-3 is taken by both
    devices' decode paths; OLMo 2 under tensor parallelism:
    tests/e2e/test_tensor_parallel_families.py.)"""
    import gguf

    window = load_model(save_hf_model(make_family_hf_model("phi3_window"), tmp_path / "w")).model
    assert window.config.decode_path_reason("cuda") is None
    PagedModelRunner(window, 8, 4, max_num_seqs=2, decode_path=True)  # the CPU's plan has it
    # Both families' files load (test_gguf_families.py); one without its metadata names the
    # missing key.
    for arch, message in (
        ("phi3", "GGUF metadata lacks phi3.embedding_length"),
        ("olmo2", "GGUF metadata lacks olmo2.embedding_length"),
    ):
        file = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(file), arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=message) as info:
            load_model(file)
        assert "\n" not in str(info.value)
