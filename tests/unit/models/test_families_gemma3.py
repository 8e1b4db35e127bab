"""Gemma 3 (text) against `transformers` on tiny random-weight checkpoints.

Each checkpoint is a `Gemma3ForCausalLM` written by `save_pretrained` and read by `load_model`
(4 layers, sliding and full attention alternating, a window of 8, the sliding layers' own RoPE
base; "gemma3_linear" adds linear RoPE scaling on the full layers, "gemma3_capped" sets both
soft-caps: `transformers` caps Gemma 3's final logits, never its attention). float32 logits agree
within 1e-4 with `transformers`: whole prompts longer than the window (the CPU's row plan and
the eager masked path), paged steps, and decode/verify steps on the decode path far past the
window; greedy generation through `LLM` equals `generate`, and n-gram speculation and draft
trees (verified under the window) equal plain greedy. Negative controls drop one Gemma rule at a
time (the embedding scale, the 1 + w of the norms, the sliding layers' RoPE base,
query_pre_attn_scalar; the final cap, also on the decode path; the attention cap applied after
all) and must move the logits by far more than the tolerance. Refusals are one-line errors that
name what is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from models_fixtures import (
    GEMMA3_CONFIGS,
    GREEDY_PROMPTS,
    NGRAM_PROMPTS,
    NGRAM_SPEC,
    decode_path_error,
    drop_final_cap,
    eager,
    hf_greedy,
    hf_logits,
    llm_greedy,
    make_gemma3_hf_model,
    max_error,
    paged_steps_error,
    prompt_error,
    prompt_tokens,
    save_hf_model,
    speculative_equals_plain,
    tree_speculation_equals_plain,
)
from specdec.engine.llm import LLM
from specdec.models import LlamaForCausalLM, ModelConfig, load_model, prompt_logits
from specdec.models.layers import RMSNorm

transformers = pytest.importorskip("transformers", reason="the forward reference")

ATOL = 1e-4
WINDOW = GEMMA3_CONFIGS["gemma3"]["sliding_window"]
SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module", params=list(GEMMA3_CONFIGS))
def gemma3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, HF model, checkpoint directory) per tiny Gemma 3 config."""
    name = request.param
    hf_model = make_gemma3_hf_model(name)
    return name, hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The "gemma3" checkpoint alone, as `gemma3` gives it (for the tests one config serves)."""
    hf_model = make_gemma3_hf_model("gemma3")
    return "gemma3", hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The "gemma3_capped" checkpoint alone, as `gemma3` gives it."""
    hf_model = make_gemma3_hf_model("gemma3_capped")
    return "gemma3_capped", hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("capped"))


PROMPTS = prompt_tokens(97, [1, 6, 29, 17], seed=2)  # three of them longer than the window


# --------------------------------------------------------------------------- config
def test_config_reads_gemma3_options(tmp_path: Path) -> None:
    """The saved config.json (transformers 5's `rope_parameters` per layer kind and explicit
    `layer_types`) and transformers 4's spelling (`rope_theta`, `rope_local_base_freq`,
    `rope_scaling`, `sliding_window_pattern`) parse to the same ModelConfig."""
    path = save_hf_model(make_gemma3_hf_model("gemma3_linear"), tmp_path)
    config = load_model(path).config
    assert (config.norm_placement, config.norm_unit_offset, config.hidden_act) == (
        "sandwich",
        True,
        "gelu_pytorch_tanh",
    )
    assert config.scale_embeddings and config.tie_word_embeddings and config.qk_norm
    assert config.query_pre_attn_scalar == 24.0 and config.sliding_window == WINDOW
    assert config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "linear"
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert [config.layer_rotates_locally(i) for i in range(4)] == [True, False, True, False]
    old_spelling = {
        **GEMMA3_CONFIGS["gemma3_linear"],
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert ModelConfig.from_hf_config(old_spelling) == config
    # Gemma 3 1B's pattern: every sixth layer full; tied embeddings when config.json is silent.
    six = {**old_spelling, "num_hidden_layers": 7}
    del six["sliding_window_pattern"]
    six_config = ModelConfig.from_hf_config(six)
    assert six_config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    assert six_config.tie_word_embeddings


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope type 'yarn' on full_attention layers is not supported",
        ),
        ({"layer_types": [SLIDING, FULL]}, "layer_types names 2 layers, the model has 4"),
    ],
)
def test_config_refusals_are_named(change: dict[str, Any], message: str) -> None:
    hf_config = {**GEMMA3_CONFIGS["gemma3"], "architectures": ["Gemma3ForCausalLM"], **change}
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_hf_config(hf_config)
    assert "\n" not in str(info.value)


def test_soft_capping_is_read_as_transformers_reads_it(capped: Any) -> None:
    """config.json's final cap is read, its attention cap left out (`transformers` and vLLM
    never pass it to Gemma 3's attention: the parity tests run "gemma3_capped" against
    `transformers`, the negative controls show that it would bind); a config.json silent on
    them caps nothing (Gemma 2's defaults are Gemma 2's alone). Nothing capped in attention:
    CUDA runs it as an uncapped Gemma 3 (the final cap is in `compute_logits`)."""
    _, _, path = capped
    config = load_model(path).config
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (None, 3.0)
    silent = ModelConfig.from_hf_config(
        {**GEMMA3_CONFIGS["gemma3"], "architectures": ["Gemma3ForCausalLM"]}
    )
    assert (silent.attn_logit_softcapping, silent.final_logit_softcapping) == (None, None)
    assert config.device_reason("cuda") is None
    assert config.decode_path_reason("cuda") == silent.decode_path_reason("cuda")


# --------------------------------------------------------------------------- parity
def test_prompt_logits_match(gemma3: Any) -> None:
    """One batched prefill of four prompts (three longer than the window), through the CPU's
    row plan and through the eager path's masked SDPA."""
    _, hf_model, path = gemma3
    assert prompt_error(load_model(path).model, hf_model, PROMPTS) <= ATOL
    assert prompt_error(eager(load_model(path).model), hf_model, PROMPTS) <= ATOL


def test_paged_steps_match(gemma3: Any) -> None:
    """Chunked prefill, decode and verify-like steps, three sequences per batch over scattered
    blocks, each past the window."""
    _, hf_model, path = gemma3
    sequences = prompt_tokens(97, [45, 9, 50], seed=3)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    schedule = [[11, 4, 13], [18, 5, 20], [1, 0, 1], [4, 0, 3], [1, 0, 1], [10, 0, 12]]
    assert paged_steps_error(load_model(path).model, references, sequences, schedule) <= ATOL


def test_decode_path_steps_match(gemma3: Any) -> None:
    """Prefill of 3 tokens, then the decode path (`DecodeMetadata`, the CPU decode plan: a
    window and a RoPE table per layer kind) in steps of 1 to 4 rows padded to 4, up to
    position 40 (five windows)."""
    _, hf_model, path = gemma3
    sequences = prompt_tokens(97, [40, 26, 33], seed=6)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    assert decode_path_error(load_model(path).model, references, sequences) <= ATOL


def test_greedy_generation_matches_transformers_generate(gemma3: Any) -> None:
    """24 greedy tokens through `LLM` (each sequence ends past the window) equal `generate`'s,
    a prompt holding token id 0 among them."""
    _, hf_model, path = gemma3
    outputs = llm_greedy(LLM(str(path), speculative_config=None), GREEDY_PROMPTS)
    for prompt, output in zip(GREEDY_PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)


def test_ngram_speculation_equals_plain_greedy(plain: Any) -> None:
    """Greedy with n-gram drafts (K pinned at 3) emits plain greedy's tokens; prompts repeat
    themselves so that n-grams match."""
    _, _, path = plain
    speculative_equals_plain(LLM(str(path), speculative_config=NGRAM_SPEC), NGRAM_PROMPTS)


@pytest.mark.parametrize("draft", ["other", "itself"])
def test_greedy_draft_tree_equals_greedy_plain(
    plain: Any, draft: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Draft trees (a draft model: another random Gemma 3, or the target itself) verified under
    the window, every sequence past it: greedy tree speculation emits plain greedy's tokens
    (tree nodes take their window from their depth: `AttentionPlan.build`)."""
    _, _, path = plain
    draft_path = path
    if draft == "other":
        other = make_gemma3_hf_model("gemma3", seed=5)
        draft_path = save_hf_model(other, tmp_path_factory.mktemp("other"))
    tree_speculation_equals_plain(path, draft_path, prompt_tokens(97, [5, 9, 14], seed=3))


# --------------------------------------------------------------------------- negative controls
def drop_embedding_scale(model: LlamaForCausalLM) -> None:
    model.model.embed_scale = None


def drop_unit_offset(model: LlamaForCausalLM) -> None:
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.unit_offset = False


def global_rope_on_sliding_layers(model: LlamaForCausalLM) -> None:
    model.model.local_rotary_emb = model.model.rotary_emb


def head_dim_scale(model: LlamaForCausalLM) -> None:
    for layer in model.model.layers:
        layer.self_attn.scale = layer.self_attn.head_dim**-0.5


@pytest.mark.parametrize(
    "breaks",
    [drop_embedding_scale, drop_unit_offset, global_rope_on_sliding_layers, head_dim_scale],
)
def test_negative_controls_move_the_logits(plain: Any, breaks: Any) -> None:
    """Each Gemma rule dropped alone (on the row plan the parity tests run): far from
    `transformers`, so the parity tests above would catch its loss."""
    _, hf_model, path = plain
    model = load_model(path).model
    breaks(model)
    assert prompt_error(model, hf_model, PROMPTS) > 100 * ATOL


def attention_cap_applied(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` capping its attention scores at config.json's `attn_logit_softcapping` after
    all, as Gemma 2 does."""
    cap = GEMMA3_CONFIGS["gemma3_capped"]["attn_logit_softcapping"]
    for layer in model.model.layers:
        layer.self_attn.softcap = cap
    return model


@pytest.mark.parametrize("breaks", [drop_final_cap, attention_cap_applied])
@pytest.mark.parametrize("path_of", [lambda model: model, eager], ids=["row_plan", "eager"])
def test_soft_capping_negative_controls_move_the_logits(
    capped: Any, breaks: Any, path_of: Any
) -> None:
    """The "gemma3_capped" checkpoint without its final cap, or with its attention capped
    after all, on either prompt path: far from `transformers`, so the parity tests above
    would catch either."""
    _, hf_model, path = capped
    model = path_of(breaks(load_model(path).model))
    assert prompt_error(model, hf_model, PROMPTS) > 100 * ATOL


def test_soft_capping_negative_control_on_the_decode_path(capped: Any) -> None:
    """The final cap dropped: the decode-path comparison above fails."""
    _, hf_model, path = capped
    sequences = prompt_tokens(97, [30, 20], seed=6)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    model = drop_final_cap(load_model(path).model)
    assert decode_path_error(model, references, sequences) > 100 * ATOL


def test_rms_norm_and_embedding_scale_are_transformers_in_bfloat16() -> None:
    """The (1 + w) norm in float32 and sqrt(D) rounded to bfloat16 (8.0 stays 8.0; 55.43
    becomes 55.5 at D = 3072): bit for bit `transformers`' in bfloat16; Llama's norm order and
    an unrounded scale, the negative controls, differ."""
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RMSNorm,
        Gemma3TextScaledWordEmbedding,
    )

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3072, generator=generator).bfloat16()
    weight = (0.3 * torch.randn(3072, generator=generator)).bfloat16()
    reference = Gemma3RMSNorm(3072, eps=1e-6).bfloat16()
    ours, llama_order = RMSNorm(3072, 1e-6, unit_offset=True), RMSNorm(3072, 1e-6)
    reference.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    ours.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    llama_order.weight = torch.nn.Parameter(1 + weight.clone(), requires_grad=False)
    with torch.no_grad():
        assert torch.equal(ours(x), reference(x))
        assert not torch.equal(llama_order(x), reference(x))
    config = ModelConfig.from_hf_config(
        {**GEMMA3_CONFIGS["gemma3"], "architectures": ["Gemma3ForCausalLM"], "hidden_size": 3072}
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    table = torch.randn(97, 3072, generator=generator).bfloat16()
    model.model.embed_tokens.weight = torch.nn.Parameter(table, requires_grad=False)
    embedding = Gemma3TextScaledWordEmbedding(97, 3072, 0, embed_scale=3072**0.5).bfloat16()
    embedding.weight = torch.nn.Parameter(table.clone(), requires_grad=False)
    ids = torch.arange(97)
    with torch.no_grad():
        assert torch.equal(model.model.embed(ids), embedding(ids))
        assert not torch.equal((table.float() * 3072**0.5).bfloat16(), embedding(ids))


# --------------------------------------------------------------------------- other paths
def test_int8_at_load_runs(plain: Any) -> None:
    """int8 weights at load (q/k/v and gate/up packed together, the tied head quantized from
    the unscaled table): prompt logits near the float model's, greedy n-gram speculation equal
    to plain greedy."""
    _, _, path = plain
    model = load_model(path, quantization="int8").model
    assert model.model.layers[0].self_attn.qkv_proj.quantized is not None
    floats = prompt_logits(load_model(path).model, PROMPTS)
    # int8 weights and the CPU kernels' bfloat16 rounding: ~0.15 here, as for the tiny Llama
    # (logits up to ~5; a wrong layout or a lost rule is off by the logits' scale).
    assert max_error(prompt_logits(model, PROMPTS), floats) < 0.5
    llm = LLM(str(path), speculative_config=NGRAM_SPEC, quantization="int8")
    speculative_equals_plain(llm, NGRAM_PROMPTS[::2])


def test_refusals_are_one_line_and_named(plain: Any) -> None:
    """A model cut to fewer layers (a `truncated:N` draft). CUDA's decode path takes the model
    (its kernels have windows and GeGLU), full layers alone too. (GGUF files of the family
    load: tests/unit/models/test_gguf_families.py; tensor parallelism:
    tests/e2e/test_tensor_parallel_families.py.)"""
    _, _, path = plain
    config = load_model(path).config
    assert config.decode_path_reason("cuda") is None
    assert config.decode_path_reason("cpu") is None
    all_full = dataclasses.replace(config, layer_types=(FULL,) * 4)
    assert all_full.decode_path_reason("cuda") is None
    with pytest.raises(ValueError, match="cannot be cut to fewer layers"):
        dataclasses.replace(config, num_hidden_layers=2)
