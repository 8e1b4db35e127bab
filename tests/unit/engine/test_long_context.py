"""Long requests on a tiny checkpoint with linear RoPE scaling (max_position_embeddings 64,
factor 8: a declared context of 512): max_model_len's default and limits through `LLM`, and every
drafter speculating up to max_model_len, far past its own declared context (64 positions),
with greedy speculative output equal to greedy plain output (CPU)."""

from __future__ import annotations

import pytest

from block_drafter_fixtures import save_tiny_block_drafter
from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.sampling import SamplingParams

CONTEXT = 512  # 64 x 8
GREEDY_TO_THE_END = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("linear"), tmp_path_factory.mktemp("linear-rope"))


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_max_model_len_defaults_to_the_scaled_context(target_dir):
    llm = LLM(str(target_dir), speculative_config=None)
    assert llm.engine.model_config.max_position_embeddings == 64
    assert llm.engine.max_model_len == CONTEXT


def test_max_model_len_is_lowered_to_what_the_cache_holds(target_dir):
    with pytest.warns(UserWarning, match="max_model_len lowered from 512 to the KV cache's 256"):
        llm = LLM(str(target_dir), speculative_config=None, num_kv_blocks=16, block_size=16)
    assert llm.engine.max_model_len == 256


def test_limits_name_both_numbers(target_dir):
    with pytest.raises(ValueError, match="max_model_len=600 exceeds the model's context of 512"):
        LLM(str(target_dir), speculative_config=None, max_model_len=600)
    llm = LLM(str(target_dir), speculative_config=None, max_model_len=300)
    prompt = prompt_tokens(97, [300])[0]
    with pytest.raises(ValueError, match=r"prompt of 300 tokens .* max_model_len=300"):
        llm.generate([prompt], GREEDY_TO_THE_END, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt of 301 tokens .* max_model_len=300"):
        llm.generate([[*prompt, 5]], GREEDY_TO_THE_END, use_tqdm=False)
    # The engine is still usable after a refused prompt.
    out = llm.generate([prompt[:299]], GREEDY_TO_THE_END, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def drafter_spec(kind: str, target_dir, tmp_path) -> dict:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3}
    if kind == "draft_model":
        return {"method": "draft_model", "model": "truncated:1", "num_speculative_tokens": 3}
    if kind == "eagle":
        head = trained_head(target_dir, tmp_path / "head", steps=2)
        return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    target = load_model(target_dir).model
    path = save_tiny_block_drafter(tmp_path / kind, kind, target, block_size=3, noise=0.05)
    return {"method": kind, "model": str(path), "num_speculative_tokens": 3}


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "eagle", "dflash", "dspark"])
def test_speculation_runs_to_max_model_len(target_dir, tmp_path, kind):
    """Prompts of 470-490 tokens (a repeated stretch, so that n-gram finds matches) generate up
    to max_model_len; the drafters' own state (paged head / draft KV, block-drafter context)
    grows with them past the 64 positions the drafters were declared for."""
    base = prompt_tokens(97, [160], seed=21)[0]
    prompts = [(base * 4)[:470], (base * 4)[5:495]]
    plain = LLM(str(target_dir), speculative_config=None, block_size=16)
    want = token_ids(plain.generate(prompts, GREEDY_TO_THE_END, use_tqdm=False))
    spec = drafter_spec(kind, target_dir, tmp_path)
    llm = LLM(str(target_dir), speculative_config=spec, block_size=16)
    out = llm.generate(prompts, GREEDY_TO_THE_END, use_tqdm=False)
    assert token_ids(out) == want
    for o in out:
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == CONTEXT
        assert o.outputs[0].finish_reason == "length"
    assert llm.get_metrics()["num_drafts"] > 0
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "truncated:1"])
def test_dynamic_rope_speculation_is_exact(tmp_path, drafter):
    """Dynamic NTK (a token's frequencies depend on its position): speculation, chunked prefill
    and batching leave the tokens unchanged, greedy and coupled-sampled, past the window."""
    target_dir = save_hf_model(make_hf_model("dynamic"), tmp_path / "dynamic-rope")
    base = prompt_tokens(97, [100], seed=22)[0]
    prompts = [(base * 3)[:200], base[:70]]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    if drafter != "ngram":
        spec = {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(target_dir), speculative_config=None, max_num_batched_tokens=64)
    llm = LLM(
        str(target_dir),
        speculative_config={**spec, "rejection_sample_method": "coupled"},
        max_num_batched_tokens=48,
    )
    for params in (greedy, sampled):
        want = token_ids(plain.generate(prompts, params, use_tqdm=False))
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert token_ids(plain.generate(prompts[:1], params, use_tqdm=False)) == want[:1]
    assert llm.get_metrics()["num_drafts"] > 0
