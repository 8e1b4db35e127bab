"""Draft noise has one call site (`Drafter.sample_draft`), keyed by the position Q of the proposed
token: checked at run time for every drafter, and by a scan of the drafter and model sources."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from models_fixtures import make_hf_model, save_hf_model
from specdec.drafters import DraftBatch, NgramDrafter
from specdec.drafters.draft_model import DraftModelDrafter, truncated_copy
from specdec.models import load_model
from specdec.rng import Stream
from specdec.sampling import SamplingTensors
from specdec.sampling import sampler as sampler_module

SRC = Path(__file__).resolve().parents[3] / "src" / "specdec"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))
    return load_model(path).model


def make_batch(methods, k=3):
    size = len(methods)
    return DraftBatch(
        token_ids=[[5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]][:size],
        seeds=torch.tensor([11, -22, 33][:size]),
        anchors=torch.tensor([6, 3, 8][:size]),
        num_draft=torch.tensor([k, 2, k][:size]),
        methods=list(methods),
        params=SamplingTensors.build(size, torch.device("cpu"), 0.9),
        request_ids=["a", "b", "c"][:size],
    )


@pytest.fixture
def noise_calls(monkeypatch):
    """Records every Gumbel draw made through the sampler, with the function that asked."""
    calls = []
    real = sampler_module.gumbel

    def spy(seeds, positions, stream, num_lanes, *, step=0):
        callers = [frame.function for frame in inspect.stack()[1:8]]
        steps = step.tolist() if isinstance(step, torch.Tensor) else [step] * len(seeds)
        calls.append((seeds.tolist(), positions.tolist(), Stream(stream), steps, callers))
        return real(seeds, positions, stream, num_lanes, step=step)

    monkeypatch.setattr(sampler_module, "gumbel", spy)
    return calls


@pytest.mark.parametrize("methods", [["standard", "block", "coupled"], ["coupled", "coupled"]])
def test_draft_model_draws_only_through_sample_draft_at_q(tiny_model, noise_calls, methods):
    drafter = DraftModelDrafter(
        truncated_copy(tiny_model, 1), 97, num_blocks=64, block_size=4, max_num_seqs=4
    )
    batch = make_batch(methods)
    proposal = drafter.propose(batch)
    assert noise_calls, "a probabilistic drafter must draw noise"
    seen: dict[int, list[int]] = {}
    seeds = batch.seeds.tolist()
    for call_seeds, positions, stream, steps, callers in noise_calls:
        assert "sample_draft" in callers
        for seed, position, step in zip(call_seeds, positions, steps, strict=True):
            row = seeds.index(seed)
            coupled = batch.methods[row] == "coupled"
            assert stream == (Stream.TARGET if coupled else Stream.DRAFT)
            assert step == (0 if coupled else int(batch.anchors[row]))  # the round anchor
            seen.setdefault(row, []).append(position)
    for b in range(batch.batch_size):
        anchor, n = int(batch.anchors[b]), int(batch.num_draft[b])
        assert sorted(seen[b]) == list(range(anchor, anchor + n))  # draft i is keyed at Q = A + i
    assert proposal.num_draft.tolist() == batch.num_draft.tolist()
    # The proposal carries the logits each draft was sampled from, in the target vocabulary.
    for b in range(batch.batch_size):
        for i in range(int(batch.num_draft[b])):
            token = int(proposal.draft_token_ids[b, i])
            assert torch.isfinite(proposal.draft_logits[b, i, token])


def test_greedy_and_ngram_drafters_draw_no_noise(tiny_model, noise_calls):
    greedy = DraftModelDrafter(
        tiny_model, 97, num_blocks=64, block_size=4, greedy=True, max_num_seqs=4
    )
    assert greedy.propose(make_batch(["standard", "block"])).draft_logits is None
    assert NgramDrafter(97).propose(make_batch(["standard"])).draft_logits is None
    assert noise_calls == []


FORBIDDEN = re.compile(
    r"\b(sample|sample_ref|gumbel|uniform|gumbel_argmax_ref|random_words)\s*\(|Stream\.\w+"
)


def test_no_drafter_or_model_file_draws_noise_itself():
    """Only drafters/base.py may call the sampler or name a stream; model and runner files never
    sample."""
    offenders = []
    files = [
        path
        for area in ("drafters", "models", "runner")
        for path in sorted((SRC / area).rglob("*.py"))
    ]
    assert any(path.parent.name == "eagle" for path in files)  # the scan sees the sub-packages
    for path in files:
        if path.name in ("base.py", "__init__.py") and path.parent.name == "drafters":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if FORBIDDEN.search(code) and not code.lstrip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("greedy", [True, False])
def test_draft_model_ragged_batch_matches_requests_alone(tiny_model, greedy):
    """Drafts fed back from the device (`first_tokens`) and read once per round: a batch whose
    requests want 3, 2 and 3 drafts gets each request's drafts and logits as proposing it alone
    does, and each request's draft state then holds its tokens plus the drafts it fed."""

    def drafter():
        made = DraftModelDrafter(
            truncated_copy(tiny_model, 1), 97, num_blocks=64, block_size=4, max_num_seqs=4
        )
        made.greedy = greedy
        return made

    methods = ["standard", "block", "coupled"]
    batch = make_batch(methods)
    together = drafter()
    proposal = together.propose(batch)
    for b in range(batch.batch_size):
        alone = DraftBatch(
            token_ids=[batch.token_ids[b]],
            seeds=batch.seeds[b : b + 1],
            anchors=batch.anchors[b : b + 1],
            num_draft=batch.num_draft[b : b + 1],
            methods=[methods[b]],
            params=SamplingTensors.build(1, torch.device("cpu"), 0.9),
            request_ids=[batch.request_ids[b]],
        )
        single = drafter().propose(alone)
        n = int(batch.num_draft[b])
        assert proposal.draft_token_ids[b, :n].tolist() == single.draft_token_ids[0, :n].tolist()
        if not greedy:
            torch.testing.assert_close(
                proposal.draft_logits[b, :n], single.draft_logits[0, :n], rtol=1e-5, atol=1e-5
            )
        state = together._states[batch.request_ids[b]]
        fed = proposal.draft_token_ids[b, : n - 1].tolist()
        assert state.token_ids == batch.token_ids[b] + fed
