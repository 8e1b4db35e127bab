"""An EAGLE-3 head (method "eagle3") beside a tensor-parallel target (two CPU ranks): the head runs
on the driver with the whole-vocabulary layers, as "eagle" heads do; greedy speculation equals
greedy plain decoding of the same engine, and the head really drafted."""

from __future__ import annotations

import pytest

from models_fixtures import save_hf_model
from public_drafter_fixtures import deep_target, eagle3_config, eagle3_tensors, write_checkpoint
from specdec import LLM, SamplingParams

pytestmark = pytest.mark.e2e


def test_eagle3_under_tensor_parallelism_equals_plain(tmp_path):
    target_dir = save_hf_model(deep_target(), tmp_path / "target")
    head = write_checkpoint(
        tmp_path / "head", eagle3_config("specforge", [1, 3, 6]), eagle3_tensors()
    )
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        str(target_dir),
        speculative_config=spec,
        tensor_parallel_size=2,
        max_model_len=64,
        num_kv_blocks=64,
    )
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        spec_out = llm.generate(prompts, params, use_tqdm=False)
        plain_out = llm.generate(prompts, params, speculative={"enabled": False}, use_tqdm=False)
        assert llm.engine.stats.num_drafts > 0
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in spec_out] == [o.outputs[0].token_ids for o in plain_out]
