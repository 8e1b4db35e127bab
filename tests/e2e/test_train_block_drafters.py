"""`specdec train-drafter --kind dflash|dspark` end to end on a tiny target: self-distillation,
training with checkpoints, resume, the held-out acceptance evaluation through the engine, and a
checkpoint that `speculative_config={"method": kind, "model": DIR}` loads."""

from __future__ import annotations

import json

import pytest

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.cli import main
from specdec.drafters.block.checkpoint import read_block_drafter_config
from specdec.engine.llm import LLM
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = save_hf_model(make_hf_model("llama"), root / "target")
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as file:
        for tokens in prompt_tokens(97, [6] * 12, seed=5):
            file.write(json.dumps({"prompt_token_ids": tokens}) + "\n")
    return target, prompts


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_train_drafter_end_to_end(corpus, tmp_path, kind, capsys):
    target, prompts = corpus
    out = tmp_path / kind
    args = [
        "train-drafter",
        "--target",
        str(target),
        "--kind",
        kind,
        "--data",
        str(prompts),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "4",
        "--gen-max-tokens",
        "24",
        "--holdout-fraction",
        "0.25",
        "--eval-prompts",
        "2",
        "--eval-max-tokens",
        "8",
        "--eval-k",
        "3",
        "--option",
        "block_size=3",
        # markov_rank is DSpark's (dflash refuses it by name)
        *(["--option", "markov_rank=8"] if kind == "dspark" else []),
    ]
    assert main([*args, "--max-steps", "4"]) == 0
    assert (out / "checkpoint.pt").is_file()
    assert main([*args, "--max-steps", "8", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().err
    result = json.loads((out / "acceptance.json").read_text())
    assert result["kind"] == kind and result["steps"] == 8
    for figures in result["acceptance"].values():
        assert figures["mean_acceptance_length"] >= 1.0
    config = read_block_drafter_config(out)
    assert (config.kind, config.block_size) == (kind, 3)
    llm = LLM(
        str(target),
        speculative_config={"method": kind, "model": str(out), "num_speculative_tokens": 3},
        max_model_len=64,
        block_size=4,
    )
    outputs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, seed=0), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 12
    assert llm.get_metrics()["num_drafts"] > 0
