"""Test helpers for the device-held rules of plain steps (`engine/request_rules.py`): twelve
requests with penalties, a bias, allowed tokens, bans and min_tokens (and some without) through
an engine whose plain steps keep their rules on the device, or rebuild a `LogitsContext` every
step."""

from __future__ import annotations

from models_fixtures import prompt_tokens
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams

VOCAB = 97
# Engine settings of the equality tests: room for all, a cache that preempts, and max_num_seqs
# 4 (four rows for ten ruled requests, so that rows are given back and written afresh).
ENGINE_CASES = {"roomy": {}, "preempting": {"num_kv_blocks": 40, "max_num_seqs": 8}}
ENGINE_CASES["few rows"] = {"max_num_seqs": 4}
RULES = [
    {"repetition_penalty": 1.8, "frequency_penalty": 0.9},
    {},
    {"presence_penalty": 1.5, "min_tokens": 6, "stop_token_ids": [3, 8, 12]},
    {"logit_bias": {5: 4.0, 9: -100.0}, "presence_penalty": 0.7},
    {"allowed_token_ids": list(range(10, 40)), "repetition_penalty": 2.0},
    {"frequency_penalty": -0.5, "bad_words": None},
]


def run(
    model_dir, async_scheduling: bool, kept: bool, preempts: bool = False, **engine_args
) -> dict:
    """Final tokens by request id: six requests at the start, six arriving at step 4
    (`preempts`: the cache must preempt some)."""
    config = EngineConfig(
        model=str(model_dir),
        max_model_len=64,
        block_size=4,
        async_scheduling=async_scheduling,
        **engine_args,
    )
    engine = LLMEngine(config, SpeculativeConfig.from_dict(None))
    if not kept:
        engine.emitter._rule_rows = 0  # every step builds a LogitsContext
    prompts = prompt_tokens(VOCAB, [5, 9, 14, 3, 7, 11] * 2, seed=8)
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 == 1 else 1.0,
            seed=30 + i,
            max_tokens=24,
            ignore_eos=True,
            **{k: v for k, v in RULES[i % len(RULES)].items() if v is not None},
        )
        for i in range(len(prompts))
    ]
    finals, steps = {}, 0
    for i in range(6):
        engine.add_request(prompts[i], params[i], request_id=str(i))
    while engine.has_unfinished:
        steps += 1
        if steps == 4:
            for i in range(6, 12):
                engine.add_request(prompts[i], params[i], request_id=str(i))
        for out in engine.step(only_finished=True):
            finals[out.request_id] = out.outputs[0].token_ids
    kept_rules = engine.emitter.request_rules
    assert (kept_rules is not None and kept_rules.num_steps > 20) == kept
    assert (engine.num_preemptions > 0) == preempts
    return finals
