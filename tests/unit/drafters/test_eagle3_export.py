"""Exporting an EAGLE-3 head (`drafters/eagle/export_eagle3.py`, `train-drafter --export SRC
--format eagle3`): what is written has the names and config keys vLLM's Eagle3LlamaForCausalLM
and SGLang's LlamaForCausalLMEagle3 load, loads back through our EAGLE-3 import path with the
same drafts and draft logits (float32, bit for bit) from a head in each config style, and is
refused by name where the two loaders would compute something else or where the head is not an
EAGLE-3 network (every head trained here).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from drafter_format_fixtures import draft_batch, observe_prefixes
from eagle_fixtures import trained_head
from models_fixtures import prompt_tokens, save_hf_model
from public_drafter_fixtures import (
    EAGLE1_CONFIG,
    deep_target,
    eagle1_tensors,
    eagle3_config,
    eagle3_tensors,
    write_checkpoint,
)
from specdec.drafters import DrafterSetup
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.eagle.export import export_head
from specdec.drafters.registry import build_drafter
from specdec.models import load_model

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB = 97
TOKENS = prompt_tokens(VOCAB, [30, 30], seed=12)
ANCHORS = [6, 25]  # the fused decode path and the general one

# The tensors both loaders read: vLLM maps `midlayer.` to `layers.0.` and reads fc (no bias),
# norm, lm_head (always: a ParallelLMHead of draft_vocab_size rows), d2t (t2d skipped); SGLang
# reads `midlayer.*`, fc, norm, lm_head, d2t as its hot-token map (t2d skipped). Neither needs
# embed_tokens (vLLM shares the target's when absent; SGLang always does).
EAGLE3_TENSORS = {
    "fc.weight",
    *(
        f"midlayer.{name}.weight"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        )
    ),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
# source style -> (capture ids in its config, extra config keys, layer prefix)
SOURCES = {
    "specforge": ([1, 3, 6], {}, "midlayer."),
    "speculators": ([2, 4, 6], {"norm_before_residual": False}, "layers.0."),
    "vllm-default": (None, {}, "midlayer."),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(deep_target(), tmp_path_factory.mktemp("deep"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir).model


def _source(path, name, **tensor_args):
    ids, extra, prefix = SOURCES[name]
    style = name.split("-")[0]
    return write_checkpoint(
        path, eagle3_config(style, ids, **extra), eagle3_tensors(prefix, **tensor_args)
    )


def _drafts(target, head_dir, k=3):
    """(draft ids [B, K], draft logits [B, K, V]) of the "eagle3" drafter of `head_dir`, fed the
    target's features, for TOKENS at ANCHORS (sampled at temperature 1, fixed seeds)."""
    spec = SpeculativeConfig(method="eagle3", model=str(head_dir), num_speculative_tokens=k)
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    batch = draft_batch(TOKENS, ANCHORS, ids, k, ["standard", "coupled"])
    proposal = drafter.propose(batch)
    return drafter, proposal.draft_token_ids, proposal.draft_logits


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_export_loads_back_with_the_same_draft_logits(target, tmp_path, name):
    source = _source(tmp_path / "src", name)
    out = export_head(source, tmp_path / "out", "eagle3", target)
    assert set(load_file(str(out / "model.safetensors"))) == EAGLE3_TENSORS
    before, ids, logits = _drafts(target, source)
    after, ids_back, logits_back = _drafts(target, out)
    assert after.feature_layers == before.feature_layers
    assert torch.equal(ids_back, ids) and torch.equal(logits_back, logits)


@pytest.mark.parametrize("name", ["specforge", "vllm-default"])
def test_the_capture_ids_are_written_for_both_loaders(target, tmp_path, name):
    """Non-default layers under both keys, one apart (vLLM's: layer inputs; SGLang's: layer
    outputs, to which it adds 1); the default layers under neither (both engines' default)."""
    out = export_head(_source(tmp_path / "src", name), tmp_path / "out", "eagle3", target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 40 and config["num_hidden_layers"] == 1
    assert not config["tie_word_embeddings"]
    if name == "vllm-default":
        assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
        return
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]  # inputs of layers 2, 4, 7
    nested = config["eagle_config"]
    assert nested == {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True}


def test_a_head_scoring_with_the_target_lm_head_writes_those_rows(target, tmp_path):
    """A full-vocabulary EAGLE-3 head without lm_head.weight (scoring with the target's): the
    export stores the target's LM head (vLLM always reads lm_head) and identity d2t / t2d."""
    ids, _, prefix = SOURCES["specforge"]
    tensors = eagle3_tensors(prefix, draft_ids=torch.arange(VOCAB))
    del tensors["lm_head.weight"]
    source = write_checkpoint(tmp_path / "src", eagle3_config("specforge", ids, VOCAB), tensors)
    out = export_head(source, tmp_path / "out", "eagle3", target)
    written = load_file(str(out / "model.safetensors"))
    assert torch.equal(written["lm_head.weight"], target.lm_head_weight)
    assert not written["d2t"].any() and written["t2d"].all()
    _, ids, logits = _drafts(target, source)
    _, ids_back, logits_back = _drafts(target, out)
    assert torch.equal(ids_back, ids) and torch.equal(logits_back, logits)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"extra": {"norm_before_residual": True}}, "norm_before_residual"),
        ({"fc_bias": True}, "fc.bias"),
        ({"own_table": True}, "embed_tokens"),
    ],
)
def test_heads_the_loaders_would_compute_otherwise_are_refused(target, tmp_path, change, named):
    ids, _, prefix = SOURCES["specforge"]
    table = 0.1 * torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(3))
    tensors = eagle3_tensors(
        prefix,
        fc_bias=change.get("fc_bias", False),
        embedding=table if "own_table" in change else None,
    )
    config = eagle3_config("specforge", ids, **change.get("extra", {}))
    source = write_checkpoint(tmp_path / "src", config, tensors)
    with pytest.raises(ValueError, match=named) as error:
        export_head(source, tmp_path / "out", "eagle3", target)
    assert "format eagle3" in str(error.value)
    assert not (tmp_path / "out").exists()


def test_heads_of_another_network_are_refused(target_dir, target, tmp_path):
    """EAGLE-1/2 heads and the heads trained here (EagleHeads) are not EAGLE-3 networks."""
    eagle1 = write_checkpoint(tmp_path / "e1", EAGLE1_CONFIG, eagle1_tensors(bias=False))
    ours = trained_head(target_dir, tmp_path / "ours", steps=1)
    for source in (eagle1, ours):
        with pytest.raises(ValueError, match="another network than EAGLE-3's"):
            export_head(source, tmp_path / "out", "eagle3", target)


def test_the_cli_exports_and_refuses_training_eagle3(target_dir, tmp_path, capsys):
    from specdec.cli import main

    source = _source(tmp_path / "src", "specforge")
    out = tmp_path / "cli"
    argv = ["train-drafter", "--target", str(target_dir), "--export", str(source)]
    assert main([*argv, "--format", "eagle3", "--out", str(out)]) == 0
    assert set(load_file(str(out / "model.safetensors"))) == EAGLE3_TENSORS
    capsys.readouterr()
    data = tmp_path / "data.txt"
    data.write_text("a b c\n")
    argv = ["train-drafter", "--target", str(target_dir), "--kind", "eagle", "--data", str(data)]
    assert main([*argv, "--format", "eagle3", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--format eagle3 is not trained here" in err[0]
