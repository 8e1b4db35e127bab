"""A logits row without a distribution (a NaN forward pass) ends its request alone: the request
finishes with finish_reason "error" and a one-line message naming the position, keeps the tokens
it emitted before and emits none from that row; the other requests of the batch emit token for
token what they emit without it. On every engine path: the synchronous step (plain, chains,
trees), the overlapped plain loop, and device rounds (the flag computed in the round and read
back with its tokens). A negative control (rounds that do not look for such rows) must fail the
same check. The tensor-level `sample` keeps refusing such a row (ValueError).

The bad row is made by `bad_logits_fixtures.unusable_logits`: the target's final hidden state of
one (request, position) row is set to NaN after the forward pass (its K/V stay clean).
"""

from __future__ import annotations

import pytest
import torch

from bad_logits_fixtures import unusable_logits
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine import device_round
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm import LLM
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams, sample

VOCAB = 97
BAD = "1"  # the request whose row goes bad
BAD_AT = 6  # ... the row of its 7th output token (position P + 6)
NGRAM = {"method": "ngram"}
DRAFT_MODEL = {"method": "draft_model", "model": "truncated:1"}
TREE = {**DRAFT_MODEL, "tree": {"nodes": 8, "depth": 4, "topk": 2}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-bad-logits"))


@pytest.fixture(scope="module")
def prompts():
    # Repeating halves give prompt lookup something to find.
    return [p + p for p in prompt_tokens(VOCAB, [5, 9, 7], seed=3)]


def make_engine(model_dir, drafter: dict | None, async_scheduling: bool, method: str):
    spec = None
    if drafter is not None:
        spec = {
            **drafter,
            "num_speculative_tokens": 3,
            "rejection_sample_method": method,
            "adaptive": False,  # K pinned: a request's tokens never depend on the batch
        }
    config = EngineConfig(
        model=str(model_dir),
        max_model_len=96,
        block_size=4,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    return LLMEngine(config, SpeculativeConfig.from_dict(spec))


def run(model_dir, prompts, ids, *, drafter, async_scheduling, method, temperature, bad_at=None):
    """Final (tokens, finish reason, error) per request id of requests `ids` (request i: prompt i,
    seed 10 + i), with request BAD's logits row of the token at P + bad_at spoiled (None: no
    spoiling); also the spoiled rows per forward call and the engine."""
    engine = make_engine(model_dir, drafter, async_scheduling, method)
    for i in ids:
        params = SamplingParams(
            temperature=temperature, seed=10 + i, max_tokens=20, ignore_eos=True
        )
        engine.add_request(prompts[i], params, request_id=str(i))

    def position_of(request):
        if bad_at is None or request.request_id != f"{BAD}#0":
            return None
        return request.num_prompt_tokens + bad_at

    finals = {}
    with unusable_logits(engine, position_of) as spoiled:
        while engine.has_unfinished:
            for out in engine.step(only_finished=True):
                (completion,) = out.outputs
                finals[out.request_id] = (
                    completion.token_ids,
                    completion.finish_reason,
                    getattr(completion, "error", None),
                )
    return finals, spoiled, engine


def check_only_the_bad_request_failed(model_dir, prompts, *, exact_length: bool, **kwargs):
    """Runs requests 0, 1, 2 with request 1's row at P + BAD_AT spoiled, and checks it against
    request 1 alone and requests 0 and 2 without it (all unspoiled). Returns the engine."""
    finals, spoiled, engine = run(model_dir, prompts, [0, 1, 2], bad_at=BAD_AT, **kwargs)
    alone, _, _ = run(model_dir, prompts, [1], **kwargs)
    others, _, _ = run(model_dir, prompts, [0, 2], **kwargs)
    assert spoiled, "the bad row was never computed"
    tokens, reason, error = finals[BAD]
    position = len(prompts[1]) + BAD_AT
    assert reason == "error"
    assert error == (
        f"the model produced no usable logits for the token at position {position} (NaN or "
        "-inf everywhere, or a +inf): the request was stopped"
    )
    # The tokens before the bad row stay emitted; nothing comes from it or after it. A
    # speculative round that reads the row emits none of its tokens, so the request may stop a
    # few tokens before the row.
    clean_tokens = alone[BAD][0]
    assert tokens == clean_tokens[: len(tokens)]
    assert len(tokens) == BAD_AT if exact_length else len(tokens) <= BAD_AT
    assert finals["0"] == others["0"] and finals["2"] == others["2"]
    assert all(reason == "length" for _, reason, _ in others.values())
    # Nothing leaks: every block is free again and nothing runs.
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert not engine.has_unfinished
    return engine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_plain_decoding(model_dir, prompts, monkeypatch, async_scheduling, temperature):
    """The synchronous step, and the overlapped plain loop (the flag read back with the tokens
    by `_resolve`: the failure must be seen there)."""
    seen = []
    resolve = LLMEngine._resolve

    def spy(self, inflight, only_finished):
        outputs = resolve(self, inflight, only_finished)
        seen.extend(o.outputs[0].finish_reason for o in outputs if o.request_id == BAD)
        return outputs

    monkeypatch.setattr(LLMEngine, "_resolve", spy)
    engine = check_only_the_bad_request_failed(
        model_dir,
        prompts,
        exact_length=True,
        drafter=None,
        async_scheduling=async_scheduling,
        method="standard",
        temperature=temperature,
    )
    if async_scheduling:
        assert engine.loop_stats.num_overlapped_steps > 10
        assert "error" in seen


@pytest.mark.parametrize(
    ("method", "temperature"), [("standard", 1.0), ("block", 1.0), ("coupled", 1.0), ("block", 0)]
)
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_speculative_synchronous_step(model_dir, prompts, drafter, method, temperature):
    check_only_the_bad_request_failed(
        model_dir,
        prompts,
        exact_length=False,
        drafter=NGRAM if drafter == "ngram" else DRAFT_MODEL,
        async_scheduling=False,
        method=method,
        temperature=temperature,
    )


@pytest.mark.parametrize(("method", "temperature"), [("standard", 1.0), ("coupled", 0.0)])
def test_tree_rounds(model_dir, prompts, method, temperature):
    """Tree rounds read the rows of the nodes they visit; the walk's bad row ends the request."""
    check_only_the_bad_request_failed(
        model_dir,
        prompts,
        exact_length=False,
        drafter=TREE,
        async_scheduling=False,
        method=method,
        temperature=temperature,
    )


def spy_rounds(monkeypatch) -> list[int]:
    """Records the positions device rounds report as unusable (`DeviceRounds.read`)."""
    positions: list[int] = []
    read = device_round.DeviceRounds.read

    def spy(self):
        read_round = read(self)
        for _, emission in read_round[0]:
            position = getattr(emission, "unusable_position", None)
            if position is not None:
                positions.append(position)
        return read_round

    monkeypatch.setattr(device_round.DeviceRounds, "read", spy)
    return positions


@pytest.mark.parametrize(
    ("method", "temperature"),
    [("standard", 1.0), ("block", 1.0), ("coupled", 1.0), ("standard", 0.0)],
)
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_device_rounds(model_dir, prompts, monkeypatch, drafter, method, temperature):
    """The round computes each slot's first bad read row on the device; the host reads it with
    the round's tokens and ends that request while the rounds go on."""
    positions = spy_rounds(monkeypatch)
    engine = check_only_the_bad_request_failed(
        model_dir,
        prompts,
        exact_length=False,
        drafter=NGRAM if drafter == "ngram" else DRAFT_MODEL,
        async_scheduling=True,
        method=method,
        temperature=temperature,
    )
    assert engine._rounds is not None and engine._rounds.num_rounds > 5
    assert positions == [len(prompts[1]) + BAD_AT]  # seen once, by a device round


def test_negative_control_rounds_that_ignore_bad_rows_fail_the_check(
    model_dir, prompts, monkeypatch
):
    """Device rounds that never flag a row (the old behaviour) let the NaN row's garbage token
    through: the same check must reject them."""
    monkeypatch.setattr(
        device_round,
        "first_unusable_read_row",
        lambda target, num_draft, num_accepted: torch.full_like(num_draft, -1),
    )
    with pytest.raises(AssertionError):
        check_only_the_bad_request_failed(
            model_dir,
            prompts,
            exact_length=False,
            drafter=DRAFT_MODEL,
            async_scheduling=True,
            method="standard",
            temperature=1.0,
        )


def test_the_first_token_and_the_llm_api(model_dir, prompts):
    """A bad row at the prompt's last position (the prefill's own sample): the request ends
    with no token, and `LLM.generate` reports it like any finished request."""
    llm = LLM(str(model_dir), max_model_len=96, block_size=4)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=8) for s in (1, 2)]

    def position_of(request):
        return request.num_prompt_tokens if request.prompt_token_ids == prompts[1] else None

    with unusable_logits(llm.engine, position_of):
        bad, good = llm.generate([prompts[1], prompts[0]], params, use_tqdm=False)
    (good_alone,) = llm.generate([prompts[0]], params[1], use_tqdm=False)
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == [] and f"position {len(prompts[1])}" in bad.outputs[0].error
    assert good.outputs[0].token_ids == good_alone.outputs[0].token_ids
    assert good.outputs[0].error is None


def test_sample_still_refuses_a_nan_row():
    """The tensor-level contract stays: `sample` refuses a row it reads with no distribution
    (it never substitutes a token the target's law did not produce)."""
    logits = torch.zeros(3, VOCAB)
    logits[2] = float("nan")
    seeds, positions = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="logits row 2 has no finite logit"):
            sample(logits, seeds, positions, temperature=temperature)
        with pytest.raises(ValueError, match="logits row 2 has no finite logit"):
            sample(logits, seeds, positions, temperature=temperature, check_values=False)
