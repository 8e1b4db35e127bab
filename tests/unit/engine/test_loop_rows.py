"""`LoopStats.rows` (`get_metrics()["loop"]["rows"]`, `/metrics` `specdec:num_rows`): the
target's query rows by kind, counted on every path. Plain decoding, synchronous and overlapped:
every prompt token is a prefill row and every emitted token after the first a plain row; with
speculation (the synchronous step and device rounds) verify rows are counted as speculative and
the prompts still as prefill rows."""

from __future__ import annotations

import pytest

from eagle_fixtures import tiny_target_and_head_fixtures
from models_fixtures import prompt_tokens
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams

VOCAB = 97
MAX_TOKENS = 9

target_dir, head_dir = tiny_target_and_head_fixtures()


def run(model_dir, spec, async_scheduling: bool) -> tuple[dict, list[list[int]]]:
    config = EngineConfig(
        model=str(model_dir), max_model_len=96, block_size=4, async_scheduling=async_scheduling
    )
    engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
    prompts = prompt_tokens(VOCAB, [5, 11, 3], seed=4)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i, temperature=1.0)
        engine.add_request(prompt, params)
    while engine.has_unfinished:
        engine.step(only_finished=True)
    return engine.loop_stats.as_dict(), prompts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_decoding_counts_prefill_and_plain_rows(target_dir, async_scheduling):
    loop, prompts = run(target_dir, None, async_scheduling)
    assert loop["rows"]["prefill"] == sum(len(p) for p in prompts)
    assert loop["rows"]["speculative"] == 0
    emitted_after_first = len(prompts) * (MAX_TOKENS - 1)
    if async_scheduling:
        assert loop["num_overlapped_steps"] > 0
        # a step launched ahead may be dropped when its request ended meanwhile
        assert loop["rows"]["plain"] >= emitted_after_first
    else:
        assert loop["rows"]["plain"] == emitted_after_first


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculation_counts_verify_rows_as_speculative(target_dir, head_dir, async_scheduling):
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
    loop, prompts = run(target_dir, spec, async_scheduling)
    assert loop["rows"]["prefill"] == sum(len(p) for p in prompts)
    assert loop["rows"]["speculative"] > 0
    if async_scheduling:
        assert loop["num_device_rounds"] > 0
