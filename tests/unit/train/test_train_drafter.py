"""`specdec train-drafter` end to end on a tiny random-weight target (self-distillation from
token-id prompts): each kind trains, checkpoints, resumes, evaluates held-out acceptance, and
writes a directory the engine loads as its drafter."""

from __future__ import annotations

import json

import pytest
import torch

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.cli import main
from specdec.drafters.eagle.head import EagleConfig, EagleHead, load_eagle_head
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.sampling import SamplingParams
from specdec.train import get_kind, kind_names
from specdec.train.init import init_parameters_, permutation
from specdec.train.kind import TrainOptions
from specdec.train.kinds.eagle import EagleKind, widen_head_

VOCAB = 97


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = [json.dumps({"prompt_token_ids": p}) for p in prompt_tokens(VOCAB, [6] * 12, seed=5)]
    path.write_text("\n".join(lines) + "\n")
    return path


def train(target_dir, prompts_file, out, kind, steps, *extra, status=0):
    argv = [
        "train-drafter",
        "--target",
        str(target_dir),
        "--kind",
        kind,
        "--data",
        str(prompts_file),
        "--out",
        str(out),
        "--max-steps",
        str(steps),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--gen-max-tokens",
        "12",
        "--holdout-fraction",
        "0.25",
        "--eval-prompts",
        "2",
        "--eval-max-tokens",
        "8",
        "--threads",
        "1",
        *extra,
    ]
    assert main(argv) == status
    return json.loads((out / "acceptance.json").read_text()) if status == 0 else None


@pytest.mark.parametrize(
    ("kind", "options"),
    [("draft_model", ["--option", "draft_layers=1"]), ("eagle", ["--option", "ttt_steps=2"])],
)
def test_train_drafter_end_to_end(target_dir, prompts_file, tmp_path, kind, options):
    out = tmp_path / kind
    first = train(target_dir, prompts_file, out, kind, 3, *options)
    assert first["steps"] == 3
    for name in ("config.json", "model.safetensors", "checkpoint.pt", "train-tokens.pt"):
        assert (out / name).is_file(), name
    for temperature in ("0.0", "1.0"):
        figures = first["acceptance"][temperature]
        assert figures["k"] == 4 and 1.0 <= figures["mean_acceptance_length"] <= 5.0
        assert len(figures["acceptance_per_position"]) == 4
    resumed = train(target_dir, prompts_file, out, kind, 4, "--resume", *options)
    assert resumed["steps"] == 4
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == 4
    llm = LLM(
        str(target_dir),
        speculative_config={"method": kind, "model": str(out), "num_speculative_tokens": 2},
        max_model_len=64,
        block_size=4,
    )
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    assert llm.get_metrics()["num_drafts"] > 0


def test_registry_lists_the_built_in_kinds():
    assert {"draft_model", "eagle", "mtp"} <= set(kind_names())
    with pytest.raises(ValueError, match="unknown drafter kind"):
        get_kind("nope")


def test_initialisation_and_order_are_pure_functions_of_the_seed():
    def fresh(seed):
        layer = torch.nn.Linear(8, 4)
        init_parameters_(layer, seed)
        return layer.weight.detach().clone()

    assert torch.equal(fresh(1), fresh(1)) and not torch.equal(fresh(1), fresh(2))
    assert fresh(1).abs().max() <= 8**-0.5
    assert permutation(3, 0, 10) == permutation(3, 0, 10)
    assert sorted(permutation(3, 1, 10)) == list(range(10))
    assert permutation(3, 0, 10) != permutation(3, 1, 10)


def test_generated_answers_repeat_each_prompt_with_its_own_seed(target_dir):
    """--gen-repeats R: every prompt is answered R times (answer r at temperatures[(i + r) %
    len], seed + r * len(prompts) + i), in prompt order, independently of the batch size (the
    waves of max_num_seqs requests); each answer follows its prompt's tokens."""
    from specdec.models import load_model
    from specdec.train.data import generate_answers

    target, _, tokenizer = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    prompts = [{"prompt_token_ids": p} for p in prompt_tokens(VOCAB, [5, 7], seed=3)]
    runs = [
        generate_answers(
            target,
            tokenizer,
            prompts,
            max_tokens=12,
            temperatures=(0.0, 1.0),
            seed=0,
            repeats=repeats,
            max_num_seqs=batch,
        )
        for repeats, batch in ((3, 8), (3, 1), (3, 2), (1, 8))
    ]
    wide, narrow, waves, single = runs
    assert len(wide) == 3 * len(prompts) and len(single) == len(prompts)
    assert wide == narrow == waves  # the batch and the waves change nothing
    # Prompt 0's answers 0 and 2 are greedy, so equal, and equal to its only answer without
    # repeats; its answer 1 is sampled.
    first = wide[:3]
    assert first[0] == first[2] == single[0]
    repeated = [p for p in prompts for _ in range(3)]
    for (tokens, prompt_len), prompt in zip(wide, repeated, strict=True):
        assert tokens[:prompt_len] == prompt["prompt_token_ids"] and len(tokens) > prompt_len


def test_a_small_corpus_still_holds_out_a_sequence():
    from specdec.train.data import TrainingSet

    def split(n: int, fraction: float = 0.05) -> tuple[int, int]:
        train_set, held = TrainingSet((0,), list(range(n))).split(fraction)
        return len(train_set.sequences), len(held.sequences)

    assert split(40) == (38, 2)  # every 20th, as before
    assert split(5) == (4, 1) and split(2) == (1, 1)
    assert split(1) == (1, 0) and split(10, 0.0) == (10, 0)


def test_nothing_held_out_is_said_loudly(target_dir, tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8]}) + "\n")
    result = train(
        target_dir, one, tmp_path / "out", "draft_model", 1, "--option", "draft_layers=1"
    )
    assert "acceptance" not in result and "held_out_loss" not in result
    assert "WARNING: nothing is held out (the data has 1 sequence(s)" in capsys.readouterr().err


def test_token_files_pool_into_data_and_annotate_like_the_prompts(target_dir, tmp_path):
    """out/train-tokens.pt keeps a run's token lists; given to another run's --data it is
    pooled in (its sequences annotated by prefills, as the prompts' answers are), and a file
    that is not one fails with its name."""
    from specdec.models import load_model
    from specdec.train.trainer import (
        TrainConfig,
        collect_data,
        load_token_lists,
        save_token_lists,
    )

    target, _, tokenizer = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    lists = prompt_tokens(VOCAB, [9, 5, 12], seed=7)
    path = tmp_path / "pool.pt"
    save_token_lists(path, lists, [3, 0, 4])
    assert load_token_lists(path) == (lists, [3, 0, 4])
    config = TrainConfig(kind="eagle", data=(str(path),), out=str(tmp_path / "out"))
    data = collect_data(config, target, tokenizer, (0, 1))
    assert [s.token_ids.tolist() for s in data.sequences] == lists
    assert [s.prompt_len for s in data.sequences] == [3, 0, 4]
    assert data.sequences[0].loss_mask.tolist() == [False, False] + [True] * 7
    assert data.sequences[2].layers.shape == (12, 2, target.config.hidden_size)
    # Kept in out/ for --resume, unchanged.
    assert load_token_lists(tmp_path / "out" / "train-tokens.pt") == (lists, [3, 0, 4])
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"bad\.pt: not a token file written by train-drafter"):
        load_token_lists(bad)


def test_prefills_share_one_cache_and_keep_float16_copies(target_dir):
    """annotate_token_lists runs every prefill on one runner's cache (a prefill after a longer
    one meets its stale K/V and must not see it): each prefill's features are those of the same
    prefill (prefills of [40], [7, 33], [5, 18] tokens) run alone, float16 tensors of their own
    (no view of a prefill's features)."""
    from specdec.models import load_model
    from specdec.train.data import annotate_token_lists

    target, _, _ = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    lists = prompt_tokens(VOCAB, [40, 7, 33, 5, 18], seed=11)
    lens = [3, 0, 2, 0, 1]
    together = annotate_token_lists(target, lists, (0, 1), lens, batch_tokens=45)
    alone = [
        seq
        for a, b in ((0, 1), (1, 3), (3, 5))
        for seq in annotate_token_lists(target, lists[a:b], (0, 1), lens[a:b], batch_tokens=45)
    ]
    for tokens, prompt_len, seq, ref in zip(lists, lens, together, alone, strict=True):
        assert torch.equal(seq.layers, ref.layers) and seq.layers.dtype == torch.float16
        assert seq.layers.shape == (len(tokens), 2, target.config.hidden_size)
        assert seq.layers.untyped_storage().nbytes() == seq.layers.numel() * 2
        assert seq.token_ids.tolist() == tokens and seq.prompt_len == prompt_len


def test_generated_answers_free_their_engine_on_return(target_dir, monkeypatch):
    """The decoding engine (whose KV cache fills the free GPU memory) is gone when
    generate_answers returns, though it sits in reference cycles: annotation comes next."""
    import gc
    import weakref

    from specdec.engine import llm_engine
    from specdec.models import load_model
    from specdec.train.data import generate_answers

    engines = []
    init = llm_engine.LLMEngine.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(weakref.ref(self))

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", tracked)
    target, _, tokenizer = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    prompts = [{"prompt_token_ids": p} for p in prompt_tokens(VOCAB, [5, 7], seed=3)]
    gc.disable()
    try:
        generate_answers(target, tokenizer, prompts, max_tokens=4, temperatures=(0.0,), seed=0)
        assert len(engines) == 1 and engines[0]() is None
    finally:
        gc.enable()


# Starting an EAGLE head from an earlier one (`--option init_from=DIR`), its MLP widened without
# changing what it computes; `--option` keys a kind does not read, refused by name.


def _head(target_config, intermediate: int, seed: int) -> EagleHead:
    config = EagleConfig.for_target(
        target_config, feature_layers=(0, 1), intermediate_size=intermediate
    )
    head = EagleHead(config)
    init_parameters_(head, seed)
    return head


def _outputs(head: EagleHead, features, embeds) -> torch.Tensor:
    """The head's layer over [T, D] inputs, the paged path's numerics as training runs them."""
    from specdec.train.dense import causal_layer

    hidden = head.project_features(features)
    x = head.layer_input(hidden, embeds)[None]
    cos, sin = head.rotary_emb(torch.arange(x.shape[1]))
    out, _ = causal_layer(head.layer, x, cos, sin)
    return head.norm(out)[0]


def test_a_widened_head_computes_what_its_source_computes(target_dir):
    target, _, _ = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    config = target.config
    source = _head(config, config.intermediate_size, seed=1)
    wide = _head(config, 2 * config.intermediate_size, seed=2)
    torch.manual_seed(0)
    features = torch.randn(7, 2 * config.hidden_size)
    embeds = torch.randn(7, config.hidden_size)
    before = _outputs(wide, features, embeds)
    assert not torch.allclose(before, _outputs(source, features, embeds), atol=1e-3)
    widen_head_(wide, source)
    torch.testing.assert_close(
        _outputs(wide, features, embeds), _outputs(source, features, embeds), rtol=0, atol=1e-5
    )
    # The new units keep their own initialisation in gate/up (so they can learn) and are
    # silenced by zero down columns.
    width = config.intermediate_size
    assert wide.layer.mlp.gate_proj.weight[width:].abs().sum() > 0
    assert wide.layer.mlp.down_proj.weight[:, width:].abs().sum() == 0
    # Negative control: without zeroing the new down columns the function changes.
    with torch.no_grad():
        wide.layer.mlp.down_proj.weight[:, width:] = 0.1
    assert not torch.allclose(
        _outputs(wide, features, embeds), _outputs(source, features, embeds), atol=1e-3
    )


def test_narrowing_or_another_shape_is_refused(target_dir):
    target, _, _ = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    config = target.config
    wide = _head(config, 2 * config.intermediate_size, seed=1)
    narrow = _head(config, config.intermediate_size, seed=2)
    with pytest.raises(ValueError, match=r"init_from: layer\.mlp\.\w+_proj\.weight is"):
        widen_head_(narrow, wide)
    other = EagleHead(EagleConfig.for_target(config, feature_layers=(0,)))
    with pytest.raises(ValueError, match=r"init_from: feature_norm\.weight is \(64,\)"):
        widen_head_(narrow, other)


def test_training_from_a_head_keeps_its_vocabulary_and_features(target_dir, prompts_file, tmp_path):
    first = tmp_path / "first"
    common = ["--option", "ttt_steps=2", "--option", "feature_layers=0,1"]
    train(target_dir, prompts_file, first, "eagle", 2, *common, "--option", "draft_vocab_size=40")
    second = tmp_path / "second"
    target_config = load_model(str(target_dir), dtype=torch.float32, device="cpu")[0].config
    wide = 2 * target_config.intermediate_size
    train(
        target_dir,
        prompts_file,
        second,
        "eagle",
        0,
        "--option",
        "ttt_steps=2",
        "--option",
        f"init_from={first}",
        "--option",
        f"intermediate_size={wide}",
    )
    head, rows = load_eagle_head(second, target_config, torch.float32, "cpu")
    start, start_rows = load_eagle_head(first, target_config, torch.float32, "cpu")
    assert head.config.feature_layers == (0, 1) and head.config.intermediate_size == wide
    assert torch.equal(rows, start_rows) and rows.shape == (40,)
    # Zero steps trained: the saved head is the widened start, which computes the same.
    torch.manual_seed(1)
    features = torch.randn(5, 2 * target_config.hidden_size)
    embeds = torch.randn(5, target_config.hidden_size)
    torch.testing.assert_close(
        _outputs(head, features, embeds), _outputs(start, features, embeds), rtol=0, atol=1e-3
    )


def test_a_start_with_another_vocabulary_or_features_is_refused(
    target_dir, prompts_file, tmp_path, capsys
):
    first = tmp_path / "first"
    train(target_dir, prompts_file, first, "eagle", 1, "--option", "draft_vocab_size=40")
    for option, match in (
        ("draft_vocab_size=50", "drafts over 40 tokens"),
        ("feature_layers=0", "reads feature_layers"),
    ):
        capsys.readouterr()
        train(
            target_dir,
            prompts_file,
            tmp_path / option.split("=")[0],
            "eagle",
            1,
            "--option",
            f"init_from={first}",
            "--option",
            option,
            status=2,
        )
        assert f"error: init_from: the head in {first} {match}" in capsys.readouterr().err


def test_options_a_kind_does_not_read_are_refused_by_name(
    target_dir, prompts_file, tmp_path, capsys
):
    train(target_dir, prompts_file, tmp_path / "e", "eagle", 1, "--option", "ttt_step=2", status=2)
    assert "error: --option ttt_step: not an option of the eagle drafter" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()  # refused before anything was loaded or written
    kind = get_kind("draft_model")
    with pytest.raises(ValueError, match="markov_rank: not an option of the draft_model"):
        kind.check_options(TrainOptions(extra={"markov_rank": "4"}))
    get_kind("dspark").check_options(TrainOptions(extra={"markov_rank": "4", "min_draft": "2"}))
    EagleKind().check_options(TrainOptions(extra={"init_from": "x", "intermediate_size": "8"}))
    assert VOCAB > 40  # the reduced vocabularies above are real reductions
