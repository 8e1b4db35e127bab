"""The EAGLE head's catch-up on the prompts of requests entering device rounds (`HeadGraphs.prompt`:
the decode path, 16 entries per request a step, replayed from "prompt" graphs on CUDA; op by op
here). Its entries get the bits the synchronous step's general catch-up gives them, so the rounds
emit the synchronous step's tokens with the standard verifier (whose tokens depend on the
drafts) at K pinned, for prompts of one step, of several, and past `PROMPT_GRAPH_STEPS` (the
eager general step), joining a running batch or entering together. Negative control: prompt
steps that write no entry change the drafts and so the tokens.

On CUDA (s44, H100) `[joining]` failed: s45 found the synchronous step itself gave the running
requests other drafts when the late request's prompt shared their catch-up (the head's general
step ran PyTorch's eager operations on CUDA, whose rows depend on the row count), while the
rounds gave the same tokens with and without the join. The general step now runs the decode
path's kernels on CUDA; `test_synchronous_drafts_do_not_depend_on_a_prompt_beside` holds the
synchronous step to it, with a deliberately batch-dependent head as its negative control."""

from __future__ import annotations

import pytest

from eagle_fixtures import VOCAB, trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.drafters.eagle import device as eagle_device
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.drafters.eagle.head import EagleHead
from specdec.drafters.eagle.head_graphs import HeadGraphs
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams

# Prompt lengths (a round feeds each request's last 4 entries; the prompt steps the rest, 16 a
# step): entering together, one to three prompt steps; with a request joining later, the first
# three past PROMPT_GRAPH_STEPS steps (the eager step, chosen for all of them) and the late one
# in three prompt steps.
LENGTHS = {False: [9, 30, 40, 20], True: [9, 30, 150, 40]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-prompt-steps"))


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    return trained_head(model_dir, tmp_path_factory.mktemp("eagle-prompt-steps"))


def run(model_dir, head_dir, rounds: bool, late: bool, add_late: bool = True) -> list[list[int]]:
    spec = {
        "method": "eagle",
        "model": str(head_dir),
        "num_speculative_tokens": 3,
        "rejection_sample_method": "standard",
        "adaptive": False,
    }
    config = EngineConfig(
        model=str(model_dir), max_model_len=256, block_size=4, async_scheduling=rounds
    )
    engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
    prompts = prompt_tokens(VOCAB, LENGTHS[late], seed=11)
    ids = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=40 + i, max_tokens=24, ignore_eos=True)
        if not (late and i == len(prompts) - 1):
            ids.append(engine.add_request(prompt, params))
    finals, steps = {}, 0
    while engine.has_unfinished:
        steps += 1
        if late and add_late and steps == 3:  # the last request joins the running rounds
            ids.append(engine.add_request(prompts[-1], params))
        for out in engine.step(only_finished=True):
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    if rounds:
        assert engine.loop_stats.num_device_rounds > 0
        if late and add_late:
            assert engine.loop_stats.num_round_joins > 0
    return [finals[i] for i in ids]


def spy(monkeypatch) -> dict[str, list[int]]:
    """Counts the prompt steps' callers: request counts and longest prompts of each path."""
    calls: dict[str, list[int]] = {"prompt": [], "eager": []}
    prompt, eager = HeadGraphs.prompt, EagleDrafter._catch_up

    def prompt_spy(self, features, tokens, firsts, counts, states):
        calls["prompt"].append(max(counts))
        return prompt(self, features, tokens, firsts, counts, states)

    def eager_spy(self, features, tokens, firsts, counts, states):
        calls["eager"].append(max(counts))
        return eager(self, features, tokens, firsts, counts, states)

    monkeypatch.setattr(HeadGraphs, "prompt", prompt_spy)
    monkeypatch.setattr(EagleDrafter, "_catch_up", eager_spy)
    return calls


@pytest.mark.parametrize("late", [False, True], ids=["together", "joining"])
def test_prompt_steps_give_the_synchronous_steps_tokens(model_dir, head_dir, monkeypatch, late):
    want = run(model_dir, head_dir, rounds=False, late=late)
    calls = spy(monkeypatch)
    got = run(model_dir, head_dir, rounds=True, late=late)
    assert got == want
    limit = eagle_device.PROMPT_GRAPH_STEPS * 16
    assert any(16 < n <= limit for n in calls["prompt"]), calls  # several prompt steps
    if late:
        assert any(n > limit for n in calls["eager"]), calls  # past the graphed steps: eager


def test_negative_control_prompt_steps_that_write_nothing(model_dir, head_dir, monkeypatch):
    want = run(model_dir, head_dir, rounds=False, late=False)
    monkeypatch.setattr(HeadGraphs, "prompt", lambda self, *args: None)
    assert run(model_dir, head_dir, rounds=True, late=False) != want


def test_synchronous_drafts_do_not_depend_on_a_prompt_beside(model_dir, head_dir):
    """The synchronous step: the running requests' tokens (standard verifier, K pinned, so they
    follow the drafts) are the same whether or not a request's prompt joins their catch-up."""
    alone = run(model_dir, head_dir, rounds=False, late=True, add_late=False)
    joined = run(model_dir, head_dir, rounds=False, late=True)
    assert joined[:3] == alone


def test_negative_control_a_batch_dependent_head(model_dir, head_dir, monkeypatch):
    """A head whose general step mixes its outputs' features when the step holds more than 40
    entries (a direction change: the output norm would undo a scale) must fail the comparison
    above."""
    alone = run(model_dir, head_dir, rounds=False, late=True, add_late=False)
    forward = EagleHead.forward_paged

    def mixed(self, hidden, *args):
        out = forward(self, hidden, *args)
        return out + out.roll(1, dims=-1) if hidden.shape[0] > 40 else out

    monkeypatch.setattr(EagleHead, "forward_paged", mixed)
    assert run(model_dir, head_dir, rounds=False, late=True)[:3] != alone
