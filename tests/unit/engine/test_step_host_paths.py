"""The step's host-side shortcuts change nothing: per-batch constants follow the batch as requests
join and leave, streamed and finished-only outputs agree, and verify groups built from part of a
proposal (ragged draft counts, some requests without drafts) see exactly their own drafts."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.emitter import _draft_rows
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams

VOCAB = 97
PARAMS = [
    SamplingParams(temperature=1.0, top_k=7, seed=1, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.6, top_p=0.8, seed=2, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, seed=3),
    SamplingParams(temperature=1.3, min_p=0.1, seed=4, max_tokens=11, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=7, n=2, ignore_eos=True),
]
# K pinned: some requests ask for standard/block, which replay only with K pinned.
SPEC = {
    "method": "draft_model",
    "model": "truncated:1",
    "num_speculative_tokens": 3,
    "adaptive": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts():
    return prompt_tokens(VOCAB, [5, 9, 3, 12, 6], seed=4)


def make_engine(model_dir, spec=None, **kwargs) -> LLMEngine:
    args = {"model": str(model_dir), "max_model_len": 64, "block_size": 4, **kwargs}
    return LLMEngine(EngineConfig(**args), SpeculativeConfig.from_dict(spec))


def run(engine, requests, *, late=(), only_finished=True):
    """Every step's outputs; `late` requests are added after the second step."""
    for prompt, params, override in requests:
        engine.add_request(prompt, params, speculative=override)
    steps = []
    while engine.has_unfinished:
        steps.append(engine.step(only_finished=only_finished))
        if len(steps) == 2:
            for prompt, params, override in late:
                engine.add_request(prompt, params, speculative=override)
    return steps


def final(steps) -> dict[str, list[list[int]]]:
    return {
        out.request_id: [o.token_ids for o in out.outputs]
        for step in steps
        for out in step
        if out.finished
    }


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "speculative"])
def test_requests_joining_and_leaving_emit_what_they_emit_alone(model_dir, prompts, spec):
    """Requests finish at different steps and others join mid-run, so the batch keeps changing:
    each request must still be sampled with its own seed and parameters."""
    overrides = [
        None,
        {"rejection_sample_method": "block"},
        None,
        {"rejection_sample_method": "coupled"},
        {"enabled": False},
    ]
    if spec is None:
        overrides = [None] * len(PARAMS)
    requests = list(zip(prompts, PARAMS, overrides, strict=True))
    batched = final(run(make_engine(model_dir, spec), requests[:3], late=requests[3:]))
    for index, request in enumerate(requests):
        alone = final(run(make_engine(model_dir, spec), [request]))
        assert batched[str(index)] == alone["0"]


def test_streamed_and_finished_only_outputs_agree(model_dir, prompts):
    requests = list(zip(prompts, PARAMS, [None] * len(PARAMS), strict=True))
    streamed = run(make_engine(model_dir, SPEC), requests, only_finished=False)
    finished = run(make_engine(model_dir, SPEC), requests, only_finished=True)
    assert len(streamed) == len(finished)
    for stream_step, finished_step in zip(streamed, finished, strict=True):
        done = [out for out in stream_step if out.finished]
        assert [out.request_id for out in done] == [out.request_id for out in finished_step]
        assert done == finished_step
    seen: dict[str, list[list[int]]] = {}
    for step in streamed:  # each step reports every running request, its tokens growing
        for out in step:
            tokens = [o.token_ids for o in out.outputs]
            before = seen.get(out.request_id, [[] for _ in tokens])
            assert all(t[: len(b)] == b for t, b in zip(tokens, before, strict=True))
            assert sum(map(len, tokens)) > sum(map(len, before))
            seen[out.request_id] = tokens


@pytest.mark.parametrize(
    ("rows", "counts"),
    [([0, 1, 2], [3, 3, 3]), ([0, 2], [3, 3]), ([2, 0, 1], [1, 3, 2]), ([1], [2])],
)
def test_draft_logits_of_a_group_are_its_rows_zero_padded(rows, counts):
    proposal = torch.randn(3, 3, 11)
    k = max(counts)
    expected = pad_sequence(
        [proposal[row, :n] for row, n in zip(rows, counts, strict=True)], batch_first=True
    )
    got = _draft_rows(proposal, rows, counts, k)
    assert torch.equal(got, expected) and got.is_contiguous()
