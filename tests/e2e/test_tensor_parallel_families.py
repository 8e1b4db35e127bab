"""Tensor parallelism of the families beyond Llama over gloo on the CPU: TP = 2 (two processes)
against TP = 1 on tiny checkpoints written by `transformers`.

- Mixture of experts, Mixtral and Qwen3-MoE (per-expert tensors as the Hub stores them, and
  Qwen3-MoE's stacked 3D ones): each rank holds a slice of every expert's columns and the
  router whole; the routed sums are added over the ranks.
- Gemma 2 and Gemma 3 (sandwich norms: each norm after attention and MLP takes the summed
  output; soft-capping, sliding windows, scaled embeddings, GeGLU).
- OLMo 2 (q/k RMSNorms over the whole projections, which the ranks split: each rank divides by
  the mean square summed over the ranks), at TP = 2 (a KV head each) and TP = 4 (each KV head on
  two ranks, counted once).

Equalities: prompt logits within LOGITS_ATOL of TP = 1 (and not equal to the bit: the sums run
in another order); the engine's greedy tokens equal TP = 1's except at a detected near-tie. A
rank's own experts without the sum over the ranks (the negative control) is far off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from models_fixtures import (
    make_family_hf_model,
    make_gemma2_hf_model,
    make_gemma3_hf_model,
    make_moe_hf_model,
    prompt_tokens,
    save_hf_model,
)
from specdec import LLM, SamplingParams
from specdec.models import load_model, prompt_logits
from specdec.models.loader import read_model_config
from specdec.models.tensor_parallel import shard_layout
from tensor_parallel_fixtures import LOGITS_ATOL, check_tokens_equal, sharded_prompt_logits

pytest.importorskip("transformers", reason="writes the tiny checkpoints")

# past the Gemma configs' sliding window of 8
PROMPTS = prompt_tokens(97, [3, 9, 21, 14], seed=5)


def _stacked(per_expert: Path, hf_model, root: Path) -> Path:
    """The same model under transformers 5's in-memory names (3D expert tensors)."""
    from safetensors.torch import save_file

    state = {key: value.contiguous() for key, value in hf_model.state_dict().items()}
    root.mkdir()
    shutil.copy(per_expert / "config.json", root / "config.json")
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families-tp")
    paths = {}
    for name in ("mixtral", "qwen3_moe"):
        hf_model = make_moe_hf_model(name)
        paths[name] = save_hf_model(hf_model, root / name)
        if name == "qwen3_moe":
            paths["qwen3_moe-stacked"] = _stacked(paths[name], hf_model, root / f"{name}-stacked")
    paths["gemma2"] = save_hf_model(make_gemma2_hf_model("gemma2"), root / "gemma2")
    paths["gemma3"] = save_hf_model(make_gemma3_hf_model("gemma3_capped"), root / "gemma3")
    paths["olmo2"] = save_hf_model(make_family_hf_model("olmo2"), root / "olmo2")
    return paths


def test_prompt_logits_match_tp1(checkpoints):
    names = list(checkpoints)
    torch.set_num_threads(1)
    references = [prompt_logits(load_model(checkpoints[n]).model, PROMPTS) for n in names]
    sharded = sharded_prompt_logits([(str(checkpoints[n]), PROMPTS) for n in names])
    for name, reference, rows in zip(names, references, sharded, strict=True):
        worst = max(float((a - b).abs().max()) for a, b in zip(rows, reference, strict=True))
        assert worst < LOGITS_ATOL, f"{name}: TP=2 logits differ from TP=1 by {worst}"
        assert worst > 0.0, f"{name}: TP=2 equals TP=1 to the bit: were the shards summed?"


def test_olmo2_over_four_ranks_matches_tp1(checkpoints):
    """Four ranks for OLMo 2's two KV heads: each KV head's k slice on two ranks, its sum of
    squares counted once in the k norm's mean square."""
    path = checkpoints["olmo2"]
    torch.set_num_threads(1)
    reference = prompt_logits(load_model(path).model, PROMPTS)
    (rows,) = sharded_prompt_logits([(str(path), PROMPTS)], world_size=4)
    worst = max(float((a - b).abs().max()) for a, b in zip(rows, reference, strict=True))
    assert 0.0 < worst < LOGITS_ATOL, worst


def test_a_rank_without_the_sum_is_far_off(checkpoints):
    """The negative control: rank 0's experts (half of each expert's columns) on every rank, as
    if the routed sums were not added over the ranks: the logits move far past LOGITS_ATOL."""
    path = checkpoints["qwen3_moe"]
    config = read_model_config(path)
    layout = shard_layout(config, 0, 2)
    assert layout.expert_intermediate == (0, config.moe_intermediate_size // 2)
    whole = load_model(path).model
    reference = prompt_logits(whole, PROMPTS)
    for layer in whole.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        for expert in experts or ():
            half = slice(layout.expert_intermediate[1], None)
            with torch.no_grad():
                expert.gate_proj.weight[half] = 0  # silu(0) * up = 0: those columns add nothing
                expert.down_proj.weight[:, half] = 0
    cut = prompt_logits(whole, PROMPTS)
    worst = max(float((a - b).abs().max()) for a, b in zip(cut, reference, strict=True))
    assert worst > 100 * LOGITS_ATOL


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma2", "olmo2"])
def test_engine_tokens_match_tp1(checkpoints, name):
    """The engine at TP = 2 emits TP = 1's greedy tokens."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    results, reference = {}, None
    for tp in (1, 2):
        torch.set_num_threads(1)
        llm = LLM(
            model=str(checkpoints[name]),
            tensor_parallel_size=tp,
            max_num_seqs=4,
            max_model_len=128,
            seed=0,
        )
        results[tp] = llm.generate(prompts, params, use_tqdm=False)
        if tp == 1:
            reference = llm
        else:
            llm.close()
    check_tokens_equal(reference.engine.model, results[1], results[2], params, f"{name} TP=2")
