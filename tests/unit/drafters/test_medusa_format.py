"""Medusa heads in FasterDecoding's format and vLLM's load as one drafter: head i's draft logits at
Q = A + i equal those of a reference written here from the published equations (residual SiLU
blocks over the target's post-norm hidden state at A - 2, then head i's vocabulary projection) to
1e-5 of their scale in float32, and references wired otherwise do not; draft noise is drawn only
by `sample_draft` at Q; speculation through `LLM` emits plain decoding's tokens; bad checkpoints
are refused by name.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from drafter_format_fixtures import (
    finals_sync_then_async,
    plain_and_speculative_tokens,
    target_hidden,
)
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import medusa_config, medusa_tensors, write_checkpoint
from specdec.drafters import DraftBatch, DrafterSetup, TargetFeatures
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.registry import build_drafter
from specdec.engine.llm import LLM
from specdec.models import AttentionMetadata, load_model
from specdec.models.weights import CheckpointError
from specdec.rng import Stream
from specdec.sampling import SamplingParams, SamplingTensors
from specdec.sampling import sampler as sampler_module

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB = 97
TOKENS = prompt_tokens(VOCAB, [20, 20, 20], seed=21)
ANCHORS = [4, 9, 17]
NUM_HEADS = 3
# (naming, residual blocks per head): FasterDecoding's names with the medusa_head. prefix (as a
# whole Medusa-2 model saves them) and without (medusa_lm_head.*), and vLLM's.
NAMINGS = [("fasterdecoding", 2), ("legacy", 1), ("vllm", 1), ("legacy", 0)]


@pytest.fixture(scope="module")
def target_hf():
    return make_hf_model("llama")


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    return save_hf_model(target_hf, tmp_path_factory.mktemp("tiny"))


def medusa_dir(path, naming, num_layers, shards=1, **extra_config):
    tensors = medusa_tensors(NUM_HEADS, num_layers, naming)
    config = {**medusa_config(NUM_HEADS, num_layers, naming), **extra_config}
    return write_checkpoint(path, config, tensors, shards), tensors


# --- The reference: Medusa's heads from their equations (nothing from specdec) ----------------


def stored(tensors, naming, head, layer, kind, num_layers):
    """A tensor by its public name: block `layer` of `head` (kind weight/bias), or the head's
    vocabulary projection (layer None)."""
    if naming == "vllm":
        name = (
            f"lm_heads.{head}.weight" if layer is None else f"blocks.{head}.layers.{layer}.{kind}"
        )
    else:
        name = f"{head}.{num_layers}.weight" if layer is None else f"{head}.{layer}.linear.{kind}"
        name = ("medusa_head." if naming == "fasterdecoding" else "") + name
    return tensors[name]


def reference_logits(
    tensors,
    naming,
    num_layers,
    target_hf,
    tokens,
    anchor,
    *,
    post_norm=True,
    at=None,
    residual=True,
):
    """[NUM_HEADS, V] Medusa logits of a round anchored at `anchor`: every head reads the
    target's hidden state at A - 2 (the one the round's input token was sampled from); head i
    applies x + SiLU(W x + b) per block, then its projection."""
    position = anchor - 2 if at is None else at
    h = target_hidden(target_hf, tokens[: anchor - 1], post_norm)[position]
    logits = []
    with torch.no_grad():
        for i in range(NUM_HEADS):
            x = h
            for j in range(num_layers):
                linear = x @ stored(tensors, naming, i, j, "weight", num_layers).T
                linear = linear + stored(tensors, naming, i, j, "bias", num_layers)
                x = torch.nn.functional.silu(linear) + (x if residual else 0)
            logits.append(x @ stored(tensors, naming, i, None, "weight", num_layers).T)
    return torch.stack(logits)


def relative_error(got, want):
    """Max |got - want| over the largest |want| (float32 rounding is relative)."""
    return float((got - want).abs().max() / want.abs().max())


# --- Our drafter ------------------------------------------------------------------------------


def propose(target_dir, head_dir, num_draft=(3, 2, 3), greedy=False, methods=None):
    """The Medusa drafter (built through the registry), fed the target's features of positions
    0 .. A - 2, proposes for TOKENS at ANCHORS at temperature 1."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(
        method="medusa",
        model=str(head_dir),
        num_speculative_tokens=NUM_HEADS,
        draft_sample_method="greedy" if greedy else "probabilistic",
    )
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    assert isinstance(drafter, MedusaDrafter)
    ids = [f"r{i}" for i in range(len(TOKENS))]
    for request_id, tokens, anchor in zip(ids, TOKENS, ANCHORS, strict=True):
        fed = tokens[: anchor - 1]
        kv = target.allocate_kv_cache(-(-len(fed) // 4), 4)
        attn = AttentionMetadata.build([len(fed)], [len(fed)], [list(range(kv.num_blocks))], 4)
        with torch.inference_mode():
            _, layers = target.forward_with_layers(
                torch.tensor(fed), torch.arange(len(fed)), attn, kv, drafter.feature_layers
            )
        split = max(1, len(fed) // 2)  # delivered in two steps, as the engine does
        drafter.observe(TargetFeatures([request_id], [0], [layers[0][:split]]))
        if split < len(fed):
            drafter.observe(TargetFeatures([request_id], [split], [layers[0][split:]]))
    batch = DraftBatch(
        token_ids=[t[:a] for t, a in zip(TOKENS, ANCHORS, strict=True)],
        seeds=torch.tensor([3, 4, 5]),
        anchors=torch.tensor(ANCHORS),
        num_draft=torch.tensor(num_draft),
        methods=methods or ["standard", "coupled", "block"],
        params=SamplingTensors.build(3, torch.device("cpu"), 1.0),
        request_ids=ids,
    )
    return drafter, batch, drafter.propose(batch)


@pytest.mark.parametrize(("naming", "num_layers"), NAMINGS)
def test_draft_logits_match_the_reference(target_dir, target_hf, tmp_path, naming, num_layers):
    head_dir, tensors = medusa_dir(tmp_path / "medusa", naming, num_layers)
    _, _, proposal = propose(target_dir, head_dir)
    assert proposal.num_draft.tolist() == [3, 2, 3]
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        want = reference_logits(tensors, naming, num_layers, target_hf, tokens, anchor)
        n = int(proposal.num_draft[b])
        assert relative_error(proposal.draft_logits[b, :n], want[:n]) < 1e-5
        assert (proposal.draft_token_ids[b, n:] == -1).all()


@pytest.mark.parametrize(
    "variant",
    [
        {"post_norm": False},  # the last layer's output before the target's final norm
        {"at": ANCHORS[2] - 3},  # the hidden state one position earlier
        {"residual": False},  # blocks without their residual connection
    ],
)
def test_a_reference_wired_otherwise_does_not_match(target_dir, target_hf, tmp_path, variant):
    """Negative controls: the comparison has the power to see each wiring choice."""
    head_dir, tensors = medusa_dir(tmp_path / "medusa", "fasterdecoding", 2)
    _, _, proposal = propose(target_dir, head_dir)
    want = reference_logits(
        tensors, "fasterdecoding", 2, target_hf, TOKENS[2], ANCHORS[2], **variant
    )
    assert relative_error(proposal.draft_logits[2], want) > 1e-3


def test_greedy_drafts_are_each_heads_top_token(target_dir, target_hf, tmp_path):
    head_dir, tensors = medusa_dir(tmp_path / "medusa", "vllm", 1, shards=2)
    _, _, proposal = propose(target_dir, head_dir, greedy=True)
    assert proposal.draft_logits is None
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        want = reference_logits(tensors, "vllm", 1, target_hf, tokens, anchor).argmax(-1)
        n = int(proposal.num_draft[b])
        assert proposal.draft_token_ids[b, :n].tolist() == want[:n].tolist()


def test_a_whole_medusa2_model_reads_only_its_heads(target_dir, target_hf, tmp_path):
    """FasterDecoding's Medusa-2 saves the heads inside the whole model (medusa_head.* beside
    the base model's tensors, one config with both): the drafter reads the heads only."""
    tensors = medusa_tensors(NUM_HEADS, 1, "fasterdecoding")
    base = {f"base_model.{n}": t for n, t in target_hf.state_dict().items()}
    config = {**target_hf.config.to_dict(), **medusa_config(NUM_HEADS, 1, "fasterdecoding")}
    head_dir = write_checkpoint(tmp_path / "medusa2", config, {**tensors, **base}, shards=2)
    _, _, proposal = propose(target_dir, head_dir)
    want = reference_logits(tensors, "fasterdecoding", 1, target_hf, TOKENS[2], ANCHORS[2])
    assert relative_error(proposal.draft_logits[2], want) < 1e-5


def test_more_drafts_than_heads_draft_one_per_head(target_dir, tmp_path):
    head_dir, _ = medusa_dir(tmp_path / "medusa", "legacy", 1)
    _, _, proposal = propose(target_dir, head_dir, num_draft=(5, 1, 0))
    assert proposal.num_draft.tolist() == [3, 1, 0]
    assert (proposal.draft_token_ids[0, :3] >= 0).all() and (
        proposal.draft_token_ids[0, 3:] < 0
    ).all()


def test_a_token_map_drafts_over_its_ids(target_dir, target_hf, tmp_path):
    """vLLM's truncated vocabulary: the heads score the token_map's ids (their projections
    stored with every row, as vLLM accepts them), -inf elsewhere."""
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:40]
    tensors = medusa_tensors(NUM_HEADS, 1, "vllm")
    tensors["token_map"] = token_map
    config = {**medusa_config(NUM_HEADS, 1, "vllm"), "truncated_vocab_size": 40}
    head_dir = write_checkpoint(tmp_path / "medusa", config, tensors)
    _, _, proposal = propose(target_dir, head_dir)
    want = reference_logits(tensors, "vllm", 1, target_hf, TOKENS[0], ANCHORS[0])
    got = proposal.draft_logits[0]
    assert torch.isinf(got).sum(-1).tolist() == [VOCAB - 40] * 3
    assert relative_error(got[:, token_map], want[:, token_map]) < 1e-5


def test_one_original_lm_head_serves_every_head(target_dir, target_hf, tmp_path):
    """vLLM's `original_lm_head`: lm_heads.0 is every head's projection."""
    tensors = medusa_tensors(NUM_HEADS, 1, "vllm")
    for i in range(1, NUM_HEADS):
        del tensors[f"lm_heads.{i}.weight"]
    config = {**medusa_config(NUM_HEADS, 1, "vllm"), "original_lm_head": True}
    head_dir = write_checkpoint(tmp_path / "medusa", config, tensors)
    _, _, proposal = propose(target_dir, head_dir)
    shared = {**tensors, **{f"lm_heads.{i}.weight": tensors["lm_heads.0.weight"] for i in (1, 2)}}
    want = reference_logits(shared, "vllm", 1, target_hf, TOKENS[2], ANCHORS[2])
    assert relative_error(proposal.draft_logits[2], want) < 1e-5


def test_draft_noise_is_drawn_only_by_sample_draft_at_q(target_dir, tmp_path, monkeypatch):
    calls = []
    real = sampler_module.gumbel

    def spy(seeds, positions, stream, num_lanes, *, step=0):
        callers = [frame.function for frame in inspect.stack()[1:8]]
        steps = step.tolist() if isinstance(step, torch.Tensor) else [step] * len(seeds)
        calls.append((seeds.tolist(), positions.tolist(), Stream(stream), steps, callers))
        return real(seeds, positions, stream, num_lanes, step=step)

    head_dir, _ = medusa_dir(tmp_path / "medusa", "fasterdecoding", 1)
    monkeypatch.setattr(sampler_module, "gumbel", spy)
    _, batch, proposal = propose(target_dir, head_dir)
    seen: dict[int, list[int]] = {}
    for seeds, positions, stream, steps, callers in calls:
        assert "sample_draft" in callers
        for seed, position, step in zip(seeds, positions, steps, strict=True):
            b = batch.seeds.tolist().index(seed)
            coupled = batch.methods[b] == "coupled"
            assert stream == (Stream.TARGET if coupled else Stream.DRAFT)
            assert step == (0 if coupled else ANCHORS[b])
            seen.setdefault(b, []).append(position)
    for b, n in enumerate(proposal.num_draft.tolist()):
        assert sorted(seen[b]) == list(range(ANCHORS[b], ANCHORS[b] + n))  # head i at Q = A + i


COMMON = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}


def _spec(head_dir, **extra):
    return {
        "method": "medusa",
        "model": str(head_dir),
        "num_speculative_tokens": NUM_HEADS,
        "adaptive": False,  # every step drafts (the policy may choose K = 0 on the CPU)
        **extra,
    }


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_greedy_speculation_equals_greedy_plain(target_dir, tmp_path, draft_sample_method):
    head_dir, _ = medusa_dir(tmp_path / "medusa", "fasterdecoding", 1)
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = _spec(head_dir, draft_sample_method=draft_sample_method)
    plain, drafted, llm = plain_and_speculative_tokens(target_dir, spec, prompts, params, **COMMON)
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("method", ["coupled", "standard"])
def test_sampled_speculation_runs_and_coupled_equals_plain_sampling(target_dir, tmp_path, method):
    """With the default verifier (coupled) the tokens are plain sampling's for the same seeds;
    standard verification runs (exact in law, other tokens)."""
    head_dir, _ = medusa_dir(tmp_path / "medusa", "vllm", 1)
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    plain = LLM(str(target_dir), **COMMON).generate(prompts, params, use_tqdm=False)
    extra = {} if method == "coupled" else {"rejection_sample_method": method}
    llm = LLM(str(target_dir), speculative_config=_spec(head_dir, **extra), **COMMON)
    assert llm.engine.speculative_config.rejection_sample_method == method
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in drafted)
    assert llm.get_metrics()["num_draft_tokens"] > 0
    if method == "coupled":
        assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]


def _load(target_dir, head_dir):
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="medusa", model=str(head_dir))
    setup = DrafterSetup(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32)
    return build_drafter(spec, target, setup)


@pytest.mark.parametrize(
    ("naming", "change", "named"),
    [
        ("fasterdecoding", "drop medusa_head.1.0.linear.bias", "'medusa_head.1.0.linear.bias'"),
        ("legacy", "drop 2.1.weight", "missing tensor '2.1.weight'"),
        ("legacy", "reshape 0.0.linear.weight", "'0.0.linear.weight' has shape"),
        ("vllm", "reshape lm_heads.2.weight", "'lm_heads.2.weight' has shape"),
        ("vllm", "add blocks.3.layers.0.weight", "does not define: 'blocks.3.layers.0.weight'"),
    ],
)
def test_bad_tensors_are_refused_by_name(target_dir, tmp_path, naming, change, named):
    action, name = change.split()
    tensors = medusa_tensors(NUM_HEADS, 1, naming)
    if action == "drop":
        del tensors[name]
    elif action == "reshape":
        tensors[name] = tensors[name][:, :-1]
    else:
        tensors[name] = torch.ones(64, 64)
    write_checkpoint(tmp_path / "bad", medusa_config(NUM_HEADS, 1, naming), tensors)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        _load(target_dir, tmp_path / "bad")


def test_configs_and_directories_without_heads_are_refused(target_dir, tmp_path):
    tensors = medusa_tensors(NUM_HEADS, 1, "legacy")
    write_checkpoint(tmp_path / "no_count", {"medusa_num_layers": 1}, tensors)
    with pytest.raises(ValueError, match="'medusa_num_heads'"):
        _load(target_dir, tmp_path / "no_count")
    write_checkpoint(
        tmp_path / "none",
        medusa_config(2, 1, "legacy"),
        {"fc.weight": tensors["0.0.linear.weight"]},
    )
    with pytest.raises(CheckpointError, match="no Medusa heads"):
        _load(target_dir, tmp_path / "none")
    wide = {**medusa_config(NUM_HEADS, 1, "vllm"), "hidden_size": 32}
    write_checkpoint(tmp_path / "wide", wide, medusa_tensors(NUM_HEADS, 1, "vllm"))
    with pytest.raises(ValueError, match="hidden_size 32"):
        _load(target_dir, tmp_path / "wide")


def test_async_scheduling_runs_medusa_on_the_synchronous_step(target_dir, tmp_path):
    """Medusa has no device path: with `async_scheduling` its rounds run in the synchronous
    step and emit what it emits."""
    head_dir, _ = medusa_dir(tmp_path / "medusa", "legacy", 1)
    spec = SpeculativeConfig.from_dict(_spec(head_dir, rejection_sample_method="standard"))
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=8)
    finals, engine = finals_sync_then_async(
        target_dir,
        spec,
        prompts,
        lambda i: SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=30 + i),
    )
    assert finals[0] == finals[1]
    assert engine.loop_stats.num_device_rounds == 0 and engine.stats.num_drafts > 0
