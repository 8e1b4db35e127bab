"""Gemma 2 against `transformers` on tiny random-weight checkpoints.

Each checkpoint is a `Gemma2ForCausalLM` written by `save_pretrained` and read by `load_model`
(4 layers, sliding and full attention alternating, a window of 8, query_pre_attn_scalar 24;
"gemma2" with attention and final logit caps that bind at this scale, "gemma2_uncapped"
without). float32 logits agree within 1e-4 with `transformers` (eager attention, the one with
soft-capping): whole prompts longer than the window (the CPU's row plan and the eager masked
path), paged steps, and decode/verify steps on the decode path against `transformers`' token
by token decoding, far past the window; greedy generation through `LLM` equals `generate`, and
n-gram speculation (also on the engine's CPU decode path: an int8 model's steps, device rounds)
and draft trees equal plain greedy. Negative controls drop one cap at a time (on the row plan,
the eager path and the decode path) and must move the logits by far more than the tolerance.
No device refuses the model (CUDA's kernels soft-cap: test_window_softcap_kernels.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from models_fixtures import (
    GEMMA2_CONFIGS,
    GREEDY_PROMPTS,
    NGRAM_PROMPTS,
    NGRAM_SPEC,
    decode_path_error,
    drop_attention_cap,
    drop_final_cap,
    eager,
    hf_decode_logits,
    hf_greedy,
    hf_logits,
    llm_greedy,
    make_gemma2_hf_model,
    paged_steps_error,
    prompt_error,
    prompt_tokens,
    save_hf_model,
    speculative_equals_plain,
    tree_speculation_equals_plain,
)
from specdec.engine.llm import LLM
from specdec.models import ModelConfig, load_model

transformers = pytest.importorskip("transformers", reason="the forward reference")

ATOL = 1e-4
WINDOW = GEMMA2_CONFIGS["gemma2"]["sliding_window"]
SLIDING, FULL = "sliding_attention", "full_attention"
PROMPTS = prompt_tokens(97, [1, 6, 29, 17], seed=2)  # three of them longer than the window


@pytest.fixture(scope="module", params=list(GEMMA2_CONFIGS))
def gemma2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, checkpoint directory) per tiny Gemma 2 config."""
    hf_model = make_gemma2_hf_model(request.param)
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The "gemma2" checkpoint alone (for the tests one config serves)."""
    hf_model = make_gemma2_hf_model("gemma2")
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("capped"))


# --------------------------------------------------------------------------- config
def test_config_reads_gemma2_options(capped: Any) -> None:
    """The saved config.json; transformers 4's spelling (no `layer_types`: sliding and full
    alternate, as Gemma2Config fills them) parses the same; absent caps take Gemma2Config's
    defaults (50, 30), null ones none."""
    _, path = capped
    config = load_model(path).config
    assert (config.norm_placement, config.norm_unit_offset, config.hidden_act) == (
        "sandwich",
        True,
        "gelu_pytorch_tanh",
    )
    assert config.scale_embeddings and config.tie_word_embeddings and not config.qk_norm
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 3.0)
    assert config.query_pre_attn_scalar == 24.0 and config.sliding_window == WINDOW
    assert config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert config.local_rope_theta is None and config.rope_theta == 10_000.0
    old_spelling = {
        **GEMMA2_CONFIGS["gemma2"],
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert ModelConfig.from_hf_config(old_spelling) == config
    silent = {k: v for k, v in old_spelling.items() if "softcapping" not in k}
    defaults = ModelConfig.from_hf_config(silent)
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping) == (50.0, 30.0)
    nulls = {**old_spelling, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    none = ModelConfig.from_hf_config(nulls)
    assert (none.attn_logit_softcapping, none.final_logit_softcapping) == (None, None)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be > 0"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be > 0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
        ({"layer_types": [SLIDING, FULL]}, "layer_types names 2 layers, the model has 4"),
    ],
)
def test_config_refusals_are_named(change: dict[str, Any], message: str) -> None:
    hf_config = {**GEMMA2_CONFIGS["gemma2"], "architectures": ["Gemma2ForCausalLM"], **change}
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_hf_config(hf_config)
    assert "\n" not in str(info.value)


def test_cuda_takes_the_caps(capped: Any) -> None:
    """CUDA's attention kernels (flash prefill, decode, split-KV) soft-cap the scores and its
    decode path has windows and GeGLU: no device refuses the model (the kernels against their
    twins: test_window_softcap_kernels.py)."""
    _, path = capped
    config = load_model(path).config
    for device in ("cuda", "cpu"):
        assert config.device_reason(device) is None
        assert config.decode_path_reason(device) is None


# --------------------------------------------------------------------------- parity
def test_prompt_logits_match(gemma2: Any) -> None:
    """One batched prefill of four prompts (three longer than the window), through the CPU's
    row plan and through the eager path's masked attention."""
    hf_model, path = gemma2
    assert prompt_error(load_model(path).model, hf_model, PROMPTS) <= ATOL
    assert prompt_error(eager(load_model(path).model), hf_model, PROMPTS) <= ATOL


def test_paged_steps_match(gemma2: Any) -> None:
    """Chunked prefill, decode and verify-like steps on the eager path, three sequences per
    batch over scattered blocks, each past the window."""
    hf_model, path = gemma2
    sequences = prompt_tokens(97, [45, 9, 50], seed=3)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    schedule = [[11, 4, 13], [18, 5, 20], [1, 0, 1], [4, 0, 3], [1, 0, 1], [10, 0, 12]]
    model = eager(load_model(path).model)
    assert paged_steps_error(model, references, sequences, schedule) <= ATOL


def test_decode_path_steps_match_transformers_decoding(gemma2: Any) -> None:
    """Prefill of 3 tokens, then the decode path (the CPU decode plan: a window per layer
    kind, capped scores) in steps of 1 to 4 rows padded to 4, up to position 40 (five
    windows), against `transformers` decoding token by token with its cache."""
    hf_model, path = gemma2
    sequences = prompt_tokens(97, [40, 26, 33], seed=6)
    references = [hf_decode_logits(hf_model, seq) for seq in sequences]
    assert decode_path_error(load_model(path).model, references, sequences) <= ATOL


def test_greedy_generation_matches_transformers_generate(gemma2: Any) -> None:
    """24 greedy tokens through `LLM` (each sequence ends past the window) equal `generate`'s,
    a prompt holding token id 0 among them."""
    hf_model, path = gemma2
    outputs = llm_greedy(LLM(str(path), speculative_config=None), GREEDY_PROMPTS)
    for prompt, output in zip(GREEDY_PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)


def test_ngram_speculation_equals_plain_greedy(capped: Any) -> None:
    """Greedy with n-gram drafts (K pinned at 3) emits plain greedy's tokens; prompts repeat
    themselves so that n-grams match."""
    _, path = capped
    speculative_equals_plain(LLM(str(path), speculative_config=NGRAM_SPEC), NGRAM_PROMPTS)


def test_greedy_draft_tree_equals_greedy_plain(capped: Any) -> None:
    """Draft trees (the target as its own draft model) verified under the window with capped
    scores (the eager path's tree mask), every sequence past the window: greedy tree
    speculation emits plain greedy's tokens."""
    _, path = capped
    tree_speculation_equals_plain(path, path, prompt_tokens(97, [5, 9, 14], seed=3))


# --------------------------------------------------------------------------- negative controls
@pytest.mark.parametrize("breaks", [drop_attention_cap, drop_final_cap])
@pytest.mark.parametrize("path_of", [lambda model: model, eager], ids=["row_plan", "eager"])
def test_negative_controls_move_the_logits(capped: Any, breaks: Any, path_of: Any) -> None:
    """Each cap dropped alone, on either prompt path: far from `transformers`, so the parity
    tests above would catch its loss."""
    hf_model, path = capped
    assert prompt_error(path_of(breaks(load_model(path).model)), hf_model, PROMPTS) > 100 * ATOL


def test_negative_control_on_the_decode_path(capped: Any) -> None:
    """The attention cap dropped: the decode-path comparison above fails."""
    hf_model, path = capped
    sequences = prompt_tokens(97, [30, 20], seed=6)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    model = drop_attention_cap(load_model(path).model)
    assert decode_path_error(model, references, sequences) > 100 * ATOL


@pytest.mark.parametrize(
    "options",
    [{"quantization": "int8"}, {"async_scheduling": "on"}],
    ids=["int8_decode_path", "device_rounds"],
)
def test_engine_decode_path_speculation_equals_plain_greedy(capped: Any, options: dict) -> None:
    """The engine's CPU decode path with capped scores: an int8 model's steps (the runner
    takes the decode path for quantized models) and speculation's device rounds (async
    scheduling): greedy n-gram speculation emits plain greedy's tokens; the float device
    rounds emit `generate`'s."""
    hf_model, path = capped
    llm = LLM(str(path), speculative_config=NGRAM_SPEC, **options)
    assert llm.engine.runner.graphs is not None  # the decode path, not the eager one
    prompts = NGRAM_PROMPTS[:2]
    speculative = speculative_equals_plain(llm, prompts)
    if "quantization" not in options:
        for prompt, output in zip(prompts, speculative, strict=True):
            assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)
