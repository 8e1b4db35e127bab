"""Exporting an EAGLE head in the EAGLE-1/2 layout (`drafters/eagle/export.py`): what is written
has the names vLLM's llama_eagle.py loads, loads back through our own import path with the same
draft logits (float32, bit for bit), and drafts greedy tokens equal to plain greedy; heads of
another layout (ours) are refused, naming each difference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from drafter_format_fixtures import draft_batch, observe_prefixes, plain_and_speculative_tokens
from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import EAGLE1_CONFIG, eagle1_tensors, write_checkpoint
from specdec.drafters import DrafterSetup
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.eagle.export import export_head
from specdec.drafters.registry import build_drafter
from specdec.models import load_model
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB = 97
TOKENS = prompt_tokens(VOCAB, [30, 30], seed=12)
ANCHORS = [6, 25]

# What vLLM's llama_eagle.py (EagleLlamaForCausalLM) reads, written out as data: its model's
# parameters are `fc.weight` (nn.Linear without bias), `layers.{i}.*` of a Llama decoder layer
# whose layer 0 has no input_layernorm, and `embedding_layernorm` / `hidden_states_layernorm`
# under `add_para_norm`; `embed_tokens` is shared with the target. Its hf_config is a Llama
# config, whose `architectures: ["LlamaForCausalLM"]` vLLM's EAGLE config handling maps to
# EagleLlamaForCausalLM for method "eagle".
VLLM_EAGLE1_TENSORS = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}
VLLM_LLAMA_CONFIG_KEYS = {
    "architectures",
    "model_type",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "bias",
}


@pytest.fixture(scope="module")
def target_hf():
    return make_hf_model("llama")


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    return save_hf_model(target_hf, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def eagle1_dir(tmp_path_factory):
    """An EAGLE-1 head without fc.bias (the layout vLLM loads exactly)."""
    weights = eagle1_tensors(bias=False)
    return write_checkpoint(tmp_path_factory.mktemp("eagle1"), EAGLE1_CONFIG, weights)


@pytest.fixture(scope="module")
def exported_dir(target_dir, eagle1_dir, tmp_path_factory):
    target = load_model(target_dir).model
    return export_head(eagle1_dir, tmp_path_factory.mktemp("exported"), "eagle", target)


def _spec(head_dir, **extra):
    return {
        "method": "eagle",
        "model": str(head_dir),
        "num_speculative_tokens": 3,
        "adaptive": False,
        **extra,
    }


def _draft_logits(target_dir, head_dir, k=3):
    """[B, K, V] the drafter of `head_dir`'s logits for TOKENS at ANCHORS (temperature 1)."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="eagle", model=str(head_dir), num_speculative_tokens=k)
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    batch = draft_batch(TOKENS, ANCHORS, ids, k, ["standard", "coupled"])
    proposal = drafter.propose(batch)
    return proposal.draft_token_ids, proposal.draft_logits


def test_the_export_has_the_names_vllm_loads(exported_dir):
    config = json.loads((exported_dir / "config.json").read_text())
    assert set(config) - {"torch_dtype", "tie_word_embeddings"} == VLLM_LLAMA_CONFIG_KEYS
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1 and config["bias"] is False
    tensors = load_file(str(exported_dir / "model.safetensors"))
    assert set(tensors) == VLLM_EAGLE1_TENSORS
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_the_export_drafts_what_the_head_drafts(target_dir, eagle1_dir, exported_dir):
    want_ids, want = _draft_logits(target_dir, eagle1_dir)
    got_ids, got = _draft_logits(target_dir, exported_dir)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got, want)


def test_greedy_speculation_with_the_export_equals_greedy_plain(target_dir, exported_dir):
    common = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, drafted, llm = plain_and_speculative_tokens(
        target_dir, _spec(exported_dir), prompts, params, **common
    )
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


def test_a_head_of_our_layout_is_refused_naming_each_difference(target_dir, tmp_path):
    head_dir = trained_head(target_dir, tmp_path / "ours", steps=1)
    target = load_model(target_dir).model
    with pytest.raises(ValueError) as error:
        export_head(head_dir, tmp_path / "out", "eagle", target)
    for name in ("feature_fc", "layer_input_norm", "output_norm"):
        assert name in str(error.value)
    assert not (tmp_path / "out").exists()


def test_an_fc_bias_is_refused(target_dir, tmp_path):
    """vLLM's fc has no bias and skips a stored one: exporting it would change vLLM's drafts."""
    head_dir = write_checkpoint(tmp_path / "b", EAGLE1_CONFIG, eagle1_tensors(bias=True))
    target = load_model(target_dir).model
    with pytest.raises(ValueError, match=r"fc\.bias"):
        export_head(head_dir, tmp_path / "out", "eagle", target)


def test_other_formats_are_refused_by_name(target_dir, eagle1_dir, tmp_path):
    target = load_model(target_dir).model
    with pytest.raises(ValueError, match="eagle3"):
        export_head(eagle1_dir, tmp_path / "out", "eagle3", target)


def _train(target_dir, out, head_format, steps=6):
    """The eagle kind trained briefly in `head_format` on random token sequences and saved in
    float32; returns the trained draft module."""
    from specdec.train.data import TrainingSet, annotate_token_lists
    from specdec.train.kind import TrainOptions
    from specdec.train.kinds.eagle import EagleKind

    target = load_model(target_dir).model
    kind = EagleKind()
    extra = {"ttt_steps": "2", "format": head_format, "save_dtype": "float32"}
    options = TrainOptions(seed=3, lr=3e-3, extra=extra)
    layers = kind.feature_layers(target, options)
    data = TrainingSet(
        layers, annotate_token_lists(target, prompt_tokens(VOCAB, [24] * 16), layers)
    )
    kind.prepare(target, data.token_counts(VOCAB), options)
    draft = kind.build(target, options)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr)
    windows = data.chunks(24)
    for step in range(steps):
        batch = data.batch([windows[(step * 4 + i) % len(windows)] for i in range(4)], 24, layers)
        loss, _ = kind.loss(draft, target, batch, options)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    kind.save(draft, target, out, options)
    return draft


def test_a_head_trained_in_the_eagle_format_is_written_as_eagle1(target_dir, tmp_path):
    """`format=eagle` trains the EAGLE-1/2 layout (the target's final norm frozen as the feature
    norm) and writes it with vLLM's names; it loads back through our import path with the same
    parameters, bit for bit, and greedy speculation with it equals greedy plain."""
    from specdec.drafters.eagle.public import load_head

    out = tmp_path / "eagle1"
    draft = _train(target_dir, out, "eagle")
    assert set(load_file(str(out / "model.safetensors"))) == VLLM_EAGLE1_TENSORS
    target = load_model(target_dir).model
    loaded, rows = load_head(out, target, torch.float32, "cpu")
    assert rows is None
    trained = dict(draft.head.named_parameters())
    assert trained.keys() == dict(loaded.named_parameters()).keys()
    for name, param in loaded.named_parameters():
        assert torch.equal(param, trained[name].detach()), name
    assert torch.equal(trained["feature_norm.weight"], target.model.norm.weight)
    test_greedy_speculation_with_the_export_equals_greedy_plain(target_dir, out)


def test_the_eagle_format_refuses_what_eagle1_cannot_hold(target_dir, tmp_path):
    from specdec.train.kind import TrainOptions
    from specdec.train.kinds.eagle import EagleKind

    target = load_model(target_dir).model
    kind = EagleKind()
    options = TrainOptions(extra={"format": "eagle", "feature_layers": "0,1"})
    kind.prepare(target, torch.ones(VOCAB), options)
    with pytest.raises(ValueError, match="feature_layers"):
        kind.build(target, options)
    options = TrainOptions(extra={"format": "eagle", "draft_vocab_size": "32"})
    kind.prepare(target, torch.ones(VOCAB), options)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        kind.build(target, options)


def test_the_cli_exports_and_refuses_in_one_line(target_dir, eagle1_dir, tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "cli"
    argv = ["train-drafter", "--target", str(target_dir), "--export", str(eagle1_dir)]
    assert main([*argv, "--format", "eagle", "--out", str(out)]) == 0
    assert set(load_file(str(out / "model.safetensors"))) == VLLM_EAGLE1_TENSORS
    capsys.readouterr()
    ours = trained_head(target_dir, tmp_path / "ours", steps=1)
    argv = ["train-drafter", "--target", str(target_dir), "--export", str(ours)]
    assert main([*argv, "--format", "eagle", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layer_input_norm" in err[0]
    assert main([*argv, "--out", str(tmp_path / "no")]) == 2
    assert "--format eagle" in capsys.readouterr().err
    assert main(["train-drafter", "--out", str(tmp_path / "no")]) == 2
    assert "--kind and --data" in capsys.readouterr().err


def test_train_drafter_format_eagle_end_to_end(target_dir, tmp_path):
    """`train-drafter --format eagle` trains, checkpoints, resumes and evaluates through the
    engine, leaving an EAGLE-1/2 directory with vLLM's names."""
    from specdec.cli import main

    data = tmp_path / "prompts.jsonl"
    prompts = prompt_tokens(VOCAB, [6] * 12, seed=5)
    data.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out"
    argv = ["train-drafter", "--target", str(target_dir), "--kind", "eagle", "--data", str(data)]
    argv += ["--out", str(out), "--format", "eagle", "--batch-size", "4", "--seq-len", "32"]
    argv += ["--warmup-steps", "2", "--checkpoint-every", "2", "--gen-max-tokens", "12"]
    argv += ["--holdout-fraction", "0.25", "--eval-prompts", "2", "--eval-max-tokens", "8"]
    argv += ["--threads", "1", "--option", "ttt_steps=2"]
    assert main([*argv, "--max-steps", "3"]) == 0
    assert main([*argv, "--max-steps", "4", "--resume"]) == 0
    figures = json.loads((out / "acceptance.json").read_text())
    assert figures["steps"] == 4
    assert 1.0 <= figures["acceptance"]["0.0"]["mean_acceptance_length"] <= 5.0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert set(load_file(str(out / "model.safetensors"))) == VLLM_EAGLE1_TENSORS
