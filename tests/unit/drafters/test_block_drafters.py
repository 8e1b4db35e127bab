"""The block drafters (dflash, dspark): draft noise only through `sample_draft` at Q, the training
layout equals the serving one, the DSpark scheduler never looks at the draft it admits, greedy
speculation equals greedy decoding through the engine, and checkpoints load as configured."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch

from block_drafter_fixtures import (
    observe_context,
    save_tiny_block_drafter,
    target_features,
    tiny_block_drafter,
)
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.drafters import DraftBatch, Drafter, TargetFeatures
from specdec.drafters.block.checkpoint import load_block_drafter, save_block_drafter
from specdec.drafters.block.dflash import DFlashDrafter
from specdec.drafters.block.dspark import ConfidenceScheduler, DSparkDrafter
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.rng import Stream
from specdec.sampling import (
    LogitsContext,
    LogitsRules,
    SampleOutput,
    SamplingParams,
    SamplingTensors,
)
from specdec.sampling import sampler as sampler_module
from specdec.train.kinds.block import drafting_rows

DRAFTERS = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}
TOKENS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir).model


def make_drafter(kind, target, **kwargs):
    if kind == "dspark":
        kwargs.setdefault("confidence_scale", 10.0)
        kwargs.setdefault("confidence_bias", -0.5)
        kwargs.setdefault("min_survival_probability", 0.3)
    return DRAFTERS[kind](tiny_block_drafter(kind, target, block_size=4, **kwargs), target)


def make_batch(methods, num_draft=(4, 2, 3), temperature=0.9):
    size = len(methods)
    return DraftBatch(
        token_ids=TOKENS[:size],
        seeds=torch.tensor([11, -22, 33][:size]),
        anchors=torch.tensor([len(t) for t in TOKENS[:size]]),
        num_draft=torch.tensor(num_draft[:size]),
        methods=list(methods),
        params=SamplingTensors.build(size, torch.device("cpu"), temperature),
        request_ids=["a", "b", "c"][:size],
    )


def ready(drafter, batch):
    observe_context(drafter, batch.request_ids, batch.token_ids)
    return drafter


@pytest.fixture
def draws(monkeypatch):
    """Every `sample_draft` call (rows, positions) and every Gumbel draw (stream, step, callers)."""
    calls = {"sample_draft": [], "gumbel": []}
    real_sample_draft = Drafter.sample_draft
    real_gumbel = sampler_module.gumbel

    def sample_draft_spy(self, logits, rows, positions, batch):
        calls["sample_draft"].append((rows.tolist(), positions.tolist()))
        return real_sample_draft(self, logits, rows, positions, batch)

    def gumbel_spy(seeds, positions, stream, num_lanes, *, step=0):
        callers = [frame.function for frame in inspect.stack()[1:8]]
        steps = step.tolist() if isinstance(step, torch.Tensor) else [step] * len(seeds)
        calls["gumbel"].append((seeds.tolist(), positions.tolist(), Stream(stream), steps, callers))
        return real_gumbel(seeds, positions, stream, num_lanes, step=step)

    monkeypatch.setattr(Drafter, "sample_draft", sample_draft_spy)
    monkeypatch.setattr(sampler_module, "gumbel", gumbel_spy)
    return calls


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_drafts_are_drawn_only_through_sample_draft_at_q(target, draws, kind):
    batch = make_batch(["standard", "block", "coupled"])
    drafter = ready(make_drafter(kind, target), batch)
    proposal = drafter.propose(batch)
    num_draft = proposal.num_draft.tolist()
    assert all(1 <= n <= want for n, want in zip(num_draft, batch.num_draft.tolist(), strict=True))
    # Every draw comes from sample_draft, on the method's stream, at Q = A + i.
    seeds = batch.seeds.tolist()
    keyed: dict[int, list[int]] = {}
    for call_seeds, positions, stream, steps, callers in draws["gumbel"]:
        assert "sample_draft" in callers
        for seed, position, step in zip(call_seeds, positions, steps, strict=True):
            row = seeds.index(seed)
            coupled = batch.methods[row] == "coupled"
            assert stream == (Stream.TARGET if coupled else Stream.DRAFT)
            assert step == (0 if coupled else int(batch.anchors[row]))
            keyed.setdefault(row, []).append(position)
    for b in range(batch.batch_size):
        anchor = int(batch.anchors[b])
        assert sorted(keyed[b]) == list(range(anchor, anchor + num_draft[b]))
    calls = draws["sample_draft"]
    if kind == "dflash":
        assert len(calls) == 1  # one batched call for the whole block
    else:
        assert len(calls) == max(num_draft)  # one call per draft index, in order
        for i, (rows, positions) in enumerate(calls):
            assert positions == [int(batch.anchors[r]) + i for r in rows]
    for b in range(batch.batch_size):
        for i in range(num_draft[b]):
            token = int(proposal.draft_token_ids[b, i])
            assert torch.isfinite(proposal.draft_logits[b, i, token])
        assert (proposal.draft_token_ids[b, num_draft[b] :] == -1).all()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_greedy_drafting_draws_no_noise(target, draws, kind):
    batch = make_batch(["standard", "coupled"])
    drafter = ready(make_drafter(kind, target), batch)
    drafter.greedy = True
    assert drafter.propose(batch).draft_logits is None
    assert draws["gumbel"] == [] and draws["sample_draft"] == []


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_training_layout_equals_serving(target, kind):
    """The many-blocks-per-sequence training pass computes what serving computes per round."""
    drafter = make_drafter(kind, target)
    tokens = prompt_tokens(97, [20], seed=3)[0]
    features = target_features(target, tokens, drafter.feature_layers)
    anchors = torch.tensor([[3, 9, 14]])
    with torch.no_grad():
        trained = drafting_rows(
            drafter.model, target, torch.tensor([tokens]), features[None].clone(), anchors
        )[0]  # [M, K, D]
    first = drafter.model.config.first_predicting_row
    for j, anchor in enumerate(anchors[0].tolist()):
        prefix = tokens[: anchor + 1]  # the anchor token is the round's input token
        request = f"r{j}"
        drafter.observe(TargetFeatures([request], [0], [features[:anchor]]))
        batch = DraftBatch(
            token_ids=[prefix],
            seeds=torch.tensor([1]),
            anchors=torch.tensor([anchor + 1]),
            num_draft=torch.tensor([4]),
            methods=["standard"],
            params=SamplingTensors.build(1, torch.device("cpu"), 1.0),
            request_ids=[request],
        )
        served = drafter.block_hidden(batch)[0, first : first + 4]
        torch.testing.assert_close(served, trained[j], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_drafts_beyond_the_block_size_are_not_proposed(target, kind):
    batch = make_batch(["standard", "coupled"], num_draft=(7, 0))
    proposal = ready(make_drafter(kind, target, min_survival_probability=0.0), batch).propose(batch)
    assert proposal.num_draft.tolist() == [4, 0]  # block_size 4; nothing asked, nothing drawn
    assert proposal.draft_token_ids.shape == (2, 4) and (proposal.draft_token_ids[1] == -1).all()


def test_scheduler_admits_from_confidences_only():
    scheduler = ConfidenceScheduler(min_survival_probability=0.5, min_draft=1)
    survival = torch.tensor([1.0, 0.9, 0.6, 0.6])
    confidence = torch.tensor([0.1, 0.6, 0.9, 0.8])
    assert scheduler.admit(0, survival, confidence).tolist() == [True] * 4
    assert scheduler.admit(1, survival, confidence).tolist() == [False, True, True, False]
    assert not ConfidenceScheduler().enabled


def test_dspark_admission_of_a_draft_ignores_its_value(target, monkeypatch):
    """Whether draft i is verified is fixed before draft i is drawn: changing the value drawn at
    step i never changes which requests have at least i + 1 drafts (later ones may change)."""
    batch = make_batch(["standard", "block", "coupled"], num_draft=(4, 4, 4), temperature=1.0)
    drafter = ready(make_drafter("dspark", target), batch)
    reference = drafter.propose(batch).num_draft
    assert reference.min() < 4, "the scheduler must truncate some chain for this test to bite"
    real = Drafter.sample_draft
    for step in range(4):
        for shift in (1, 2, 5):
            calls: list[list[int]] = []

            def altered(self, logits, rows, positions, batch, step=step, shift=shift, calls=calls):
                out = real(self, logits, rows, positions, batch)
                calls.append(rows.tolist())
                if len(calls) - 1 != step:
                    return out
                tokens = (out.token_ids + shift) % logits.shape[-1]
                return SampleOutput(tokens, out.processed_logits, out.logsumexp)

            monkeypatch.setattr(Drafter, "sample_draft", altered)
            changed = drafter.propose(batch).num_draft
            assert ((changed > step) == (reference > step)).all()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_observe_rewinds_and_rejects_gaps(target, kind):
    drafter = make_drafter(kind, target)
    batch = make_batch(["standard"])
    with pytest.raises(ValueError, match="target features"):
        drafter.propose(batch)  # nothing observed
    observe_context(drafter, ["a"], [TOKENS[0]])
    rows = torch.zeros(2, drafter.model.fc.weight.shape[1])
    with pytest.raises(ValueError, match="start at position"):
        drafter.observe(TargetFeatures(["a"], [9], [rows]))
    observe_context(drafter, ["a"], [TOKENS[0]])  # from position 0 again: rewinds
    assert drafter.propose(batch).num_draft.tolist()[0] >= 1
    drafter.release("a")
    with pytest.raises(ValueError, match="target features"):
        drafter.propose(batch)


def test_checkpoint_round_trip_and_kind_checks(target, tmp_path):
    model = tiny_block_drafter("dspark", target, confidence_scale=1.0)
    save_block_drafter(model, tmp_path / "dspark")
    loaded = load_block_drafter(tmp_path / "dspark", target)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    spec = type("Spec", (), {"model": str(tmp_path / "dspark"), "draft_sample_method": "greedy"})
    with pytest.raises(ValueError, match='not "dflash"'):
        DFlashDrafter.from_config(spec, target)
    assert DSparkDrafter.from_config(spec, target).greedy
    other = load_model(save_hf_model(make_hf_model("smollm2_tied"), tmp_path / "other")).model
    with pytest.raises(ValueError, match=r"layers|hidden size|vocabulary"):
        load_block_drafter(tmp_path / "dspark", other)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("draft_sample_method", ["probabilistic", "greedy"])
def test_greedy_speculation_equals_greedy_decoding(
    target_dir, target, tmp_path, kind, draft_sample_method
):
    path = save_tiny_block_drafter(
        tmp_path / kind,
        kind,
        target,
        block_size=4,
        confidence_scale=10.0,
        confidence_bias=-0.5,
        min_survival_probability=0.3 if kind == "dspark" else 0.0,
        noise=0.05,
    )
    prompts = prompt_tokens(97, [5, 9, 3, 12], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for method in (None, "standard", "block", "coupled"):
        spec = None
        if method is not None:
            spec = {
                "method": kind,
                "model": str(path),
                "num_speculative_tokens": 4,
                "rejection_sample_method": method,
                "draft_sample_method": draft_sample_method,
            }
        llm = LLM(str(target_dir), speculative_config=spec, max_model_len=64, block_size=4)
        out = llm.generate(prompts, params, use_tqdm=False)
        outputs[method] = [o.outputs[0].token_ids for o in out]
        if method is not None:
            assert llm.get_metrics()["num_drafts"] > 0
    for method in ("standard", "block", "coupled"):
        assert outputs[method] == outputs[None]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_one_token_prompts_draft_from_their_second_round(target_dir, target, tmp_path, kind):
    """A one-token prompt's first round has no target feature yet: the block drafters draft
    nothing for it then (they raised before), alone and beside longer prompts."""
    path = save_tiny_block_drafter(tmp_path / kind, kind, target, block_size=3, noise=0.05)
    spec = {"method": kind, "model": str(path), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5], [5, 9, 3], [7]]
    plain = LLM(str(target_dir), max_model_len=64, block_size=4)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target_dir), speculative_config=spec, max_model_len=64, block_size=4)
    for batch in ([prompts[0]], prompts):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        assert got == want[: len(batch)]
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize(("kind", "method"), [("dflash", "standard"), ("dspark", "block")])
def test_seeded_runs_replay_alone_batched_permuted_and_preempted(
    target_dir, target, tmp_path, kind, method
):
    """The drafter's per-request context survives batching, reordering and preemption (release,
    then features re-delivered from position 0): a seeded request emits the same tokens."""
    path = save_tiny_block_drafter(
        tmp_path / kind,
        kind,
        target,
        block_size=4,
        confidence_scale=10.0,
        confidence_bias=-0.5,
        min_survival_probability=0.3 if kind == "dspark" else 0.0,
    )
    spec = {
        "method": kind,
        "model": str(path),
        "num_speculative_tokens": 4,
        "rejection_sample_method": method,
        "adaptive": False,  # standard/block replay with K pinned (the policy's K depends on timing)
    }
    prompts = prompt_tokens(97, [5, 9, 14, 3], seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)

    def run(prompt_list, **kwargs):
        args = {"max_model_len": 64, "block_size": 4, **kwargs}
        llm = LLM(str(target_dir), speculative_config=spec, **args)
        return [o.outputs[0].token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)]

    batched = run(prompts)
    assert run(prompts[::-1])[::-1] == batched
    assert [run([p])[0] for p in prompts] == batched
    # 12 blocks x 4 slots cannot hold the four requests at once: some are preempted.
    assert run(prompts, num_kv_blocks=12, max_model_len=48) == batched


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_context_rules_see_the_drafts_before_each_draft(target, kind):
    """With a context (two allowed tokens, each banned right after itself as a bad word), draft j
    is processed with drafts 0..j-1 as output, even when the drafter draws all K in one call:
    every chain alternates and each draft's recorded support is exactly the token it could be.
    Without the drafts as context the same drafter repeats a token in some chain (the check
    has power)."""
    a, b = 17, 42
    rules = LogitsRules(allowed_token_ids=(a, b), bad_words_token_ids=((a, a), (b, b)))
    repeats = 0
    for seed in range(8):
        batch = dataclasses.replace(
            make_batch(["standard", "block", "coupled"], num_draft=(4, 4, 4), temperature=1.5),
            seeds=torch.tensor([11, -22, 33]) + 1000 * seed,
        )
        with_context = dataclasses.replace(
            batch, context=LogitsContext([rules] * 3, batch.token_ids, [[], [], []])
        )
        drafter = ready(make_drafter(kind, target, min_survival_probability=0.0), batch)
        proposal = drafter.propose(with_context)
        for row, n in enumerate(proposal.num_draft.tolist()):
            chain = proposal.draft_token_ids[row, :n].tolist()
            assert set(chain) <= {a, b} and all(x != y for x, y in itertools.pairwise(chain))
            for j in range(1, n):
                support = torch.isfinite(proposal.draft_logits[row, j]).nonzero().flatten()
                assert support.tolist() == [chain[j]]
        only_allowed = [LogitsRules(allowed_token_ids=(a, b))] * 3
        blind = dataclasses.replace(
            batch, context=LogitsContext(only_allowed, batch.token_ids, [[], [], []])
        )
        drafter = ready(make_drafter(kind, target, min_survival_probability=0.0), batch)
        proposal = drafter.propose(blind)
        for row, n in enumerate(proposal.num_draft.tolist()):
            chain = proposal.draft_token_ids[row, :n].tolist()
            repeats += sum(x == y for x, y in itertools.pairwise(chain))
    assert repeats > 0
