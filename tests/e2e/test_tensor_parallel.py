"""Tensor parallelism over gloo on the CPU: TP = 2 (two processes) against TP = 1 on the built-in
SmolLM2 (float32 weights: its GGUF blocks dequantized, so both run the same float math and only
the order of the row-parallel sums differs).

Equalities: prompt logits within LOGITS_ATOL on 10 prompts; greedy and seeded sampled tokens
equal with speculation off, with the default EAGLE head and with n-gram drafts, except at a
detected near-tie (two top scores closer than NEAR_TIE at the first differing token), which is
reported as a warning, never hidden. Failure: a killed worker fails the engine naming its rank
within seconds. The built-in model has 9 heads and 3 KV heads: TP = 2 splits them 1 + 2 groups.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models import prompt_logits
from specdec.runner.tensor_parallel import WorkerDiedError
from tensor_parallel_fixtures import (
    LOGITS_ATOL,
    PROMPTS,
    check_tokens_equal,
    sharded_prompt_logits,
)

MAX_TOKENS = 12
ENGINE_ARGS = dict(quantization=None, max_num_seqs=16, max_model_len=256, seed=0)


def _engine(tp: int, speculative_config) -> LLM:
    torch.set_num_threads(1)
    return LLM(tensor_parallel_size=tp, speculative_config=speculative_config, **ENGINE_ARGS)


def test_prompt_logits_match_tp1():
    reference_llm = _engine(1, None)
    tokenizer = reference_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    reference = prompt_logits(reference_llm.engine.model, prompts)
    (sharded,) = sharded_prompt_logits([(None, prompts)])
    worst = max(float((a - b).abs().max()) for a, b in zip(sharded, reference, strict=True))
    assert worst < LOGITS_ATOL, f"TP=2 logits differ from TP=1 by {worst}"
    assert worst > 0.0, "TP=2 logits equal TP=1 to the bit: were the shards summed at all?"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_tokens_match_tp1(method):
    """Greedy and seeded sampled tokens of TP = 2 equal TP = 1, speculation on and off."""
    spec = "auto" if method == "eagle" else {"method": "ngram", "num_speculative_tokens": 3}
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1234)
    results = {}
    for tp in (1, 2):
        llm = _engine(tp, spec)
        assert llm.engine.drafter is not None
        runs = {}
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            for enabled in (True, False):
                speculative = {"enabled": enabled}
                runs[name, enabled] = llm.generate(
                    PROMPTS, params, speculative=speculative, use_tqdm=False
                )
        assert llm.engine.stats.num_drafts > 0  # the drafter really ran (on the driver)
        if tp == 1:
            reference = llm
        else:
            llm.close()
        results[tp] = runs
    for (name, enabled), outputs_1 in results[1].items():
        params = greedy if name == "greedy" else sampled
        what = f"{method} {name} speculation {'on' if enabled else 'off'}"
        check_tokens_equal(
            reference.engine.model, outputs_1, results[2][name, enabled], params, what
        )


def test_overlapped_plain_decoding_matches_tp1():
    """async_scheduling=True without speculation under TP = 2: every step overlapped, the
    prefill's too (its input tokens, sampled on the driver's device and not read by the host,
    broadcast to the worker), greedy and seeded sampled tokens equal to TP = 1's overlapped
    decoding."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=99)
    prompts = PROMPTS[:4]
    results = {}
    for tp in (1, 2):
        torch.set_num_threads(1)
        llm = LLM(
            tensor_parallel_size=tp, async_scheduling=True, speculative_config=None, **ENGINE_ARGS
        )
        results[tp] = [llm.generate(prompts, p, use_tqdm=False) for p in (greedy, sampled)]
        assert llm.get_metrics()["loop"]["num_overlapped_steps"] == 2 * 8, tp
        if tp == 1:
            reference = llm
        else:
            llm.close()
    for params, outputs_1, outputs_2 in zip((greedy, sampled), results[1], results[2], strict=True):
        what = f"overlapped TP=2, T = {params.temperature}"
        check_tokens_equal(reference.engine.model, outputs_1, outputs_2, params, what)


def test_graphed_prefill_matches_tp1():
    """Graphed prefill (`prefill_graph_tokens`, the CUDA default, asked for here) under TP = 2:
    every rank routes a step of short prefill chunks to the decode path's last-row step alike;
    greedy tokens equal TP = 1's with the same chunks. (n-gram device rounds: what gives this
    float model its decode path on the CPU.)"""
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [*PROMPTS[:3], " ".join(PROMPTS)]  # the last one prefills in several chunks
    results = {}
    for tp in (1, 2):
        torch.set_num_threads(1)
        llm = LLM(
            tensor_parallel_size=tp,
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
            prefill_graph_tokens=128,
            **ENGINE_ARGS,
        )
        results[tp] = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.get_metrics()["loop"]["num_graphed_prefill_steps"] >= 1, tp
        if tp == 1:
            reference = llm
        else:
            llm.close()
    check_tokens_equal(
        reference.engine.model, results[1], results[2], greedy, "graphed prefill TP=2"
    )


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(
            {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
            marks=pytest.mark.slow,  # the eagle case runs the same rounds in the default CI run
        ),
        {"method": "eagle", "num_speculative_tokens": 2, "adaptive": False},  # the shipped head
    ],
    ids=["ngram", "eagle"],
)
def test_device_rounds_match_tp1(spec):
    """async_scheduling=True with speculation under TP = 2: the speculative rounds run on the
    driver's device and the worker runs each round's target step beside it (the step's inputs,
    filled on the device, broadcast from rank 0); K pinned, so greedy and seeded sampled tokens
    equal TP = 1's rounds, with the same rounds and accepted drafts."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=1234)
    prompts = PROMPTS[:4]
    results, metrics = {}, {}
    for tp in (1, 2):
        torch.set_num_threads(1)
        llm = LLM(
            tensor_parallel_size=tp, async_scheduling=True, speculative_config=spec, **ENGINE_ARGS
        )
        results[tp] = [llm.generate(prompts, p, use_tqdm=False) for p in (greedy, sampled)]
        metrics[tp] = llm.get_metrics()
        assert metrics[tp]["loop"]["num_device_rounds"] > 0, tp
        if tp == 1:
            reference = llm
        else:
            llm.close()
    for params, outputs_1, outputs_2 in zip((greedy, sampled), results[1], results[2], strict=True):
        what = f"device rounds TP=2 {spec['method']}, T = {params.temperature}"
        check_tokens_equal(reference.engine.model, outputs_1, outputs_2, params, what)
    for key in ("num_drafts", "num_accepted_tokens"):
        assert metrics[1][key] == metrics[2][key], (key, metrics[1][key], metrics[2][key])
    assert metrics[2]["num_accepted_tokens"] > 0


def test_killed_worker_fails_with_its_rank():
    llm = _engine(2, None)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    worker = llm.engine.runner._group.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert time.monotonic() - started < 10
    llm.close()


@pytest.mark.slow
def test_worker_killed_mid_generation_fails_within_seconds():
    llm = _engine(2, None)
    worker = llm.engine.runner._group.processes[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate(PROMPTS * 4, params, use_tqdm=False)
    assert time.monotonic() - started < 20
    llm.close()


def test_worker_killed_during_device_rounds_fails_within_seconds():
    llm = LLM(
        tensor_parallel_size=2,
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        **ENGINE_ARGS,
    )
    worker = llm.engine.runner._group.processes[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    rounds = llm.engine.loop_stats
    killed_at = []

    def kill_once_rounds_run():
        # (not at a fixed time: on a busy machine the first synchronous steps can take longer)
        deadline = time.monotonic() + 60
        while rounds.num_device_rounds == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL)

    threading.Thread(target=kill_once_rounds_run, daemon=True).start()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate(PROMPTS * 4, params, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 20
    assert rounds.num_device_rounds > 0  # the worker died while the rounds ran
    llm.close()


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, "tensor_parallel_size must be an integer >= 1"),
        (-1, "tensor_parallel_size must be an integer >= 1"),
        (4, "tensor_parallel_size=4 cannot split 9 attention heads with 3 KV heads"),
    ],
)
def test_bad_tensor_parallel_size_is_one_line(size, message):
    with pytest.raises(ValueError, match=message) as info:
        LLM(tensor_parallel_size=size, speculative_config=None, **ENGINE_ARGS)
    assert "\n" not in str(info.value)


def test_the_near_tie_check_rejects_a_real_difference():
    """Negative control: a TP = N output that differs where TP = 1's top two logits are far
    apart must fail `check_tokens_equal` (it only forgives near-ties)."""
    from types import SimpleNamespace

    llm = _engine(1, None)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    (output,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    changed = SimpleNamespace(
        prompt_token_ids=output.prompt_token_ids,
        seed=output.seed,
        outputs=[SimpleNamespace(token_ids=[(tokens[0] + 1) % 49152, *tokens[1:]])],
    )
    with pytest.raises(AssertionError, match="is no near-tie"):
        check_tokens_equal(llm.engine.model, [output], [changed], params, "control")


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    from specdec.engine.setup import check_gpu_count

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices") as info:
        check_gpu_count(2, torch.device("cuda"))
    assert "\n" not in str(info.value)
    check_gpu_count(2, torch.device("cpu"))  # CPU ranks are processes: no limit


# Kept-quantized GGUF kernels round activations and partial sums to bfloat16: TP = 2 adds two
# rounded partial sums where TP = 1 rounds one, so scores may differ by a few bf16 steps (0.0625
# at a logit of 8-16). A first difference within 4 such steps is a near-tie at that precision.
BF16_NEAR_TIE = 0.25


@pytest.mark.slow
def test_gguf_blocks_kept_quantized_run_under_tp2():
    """The CPU default for the built-in GGUF (`quantization="auto"`: its Q4_1 / Q8_0 blocks kept,
    the planned CPU decode path) at TP = 2: greedy tokens equal TP = 1's except where TP = 1's
    top-2 scores at the first difference are within BF16_NEAR_TIE (measured: 0.0625 and 0.156
    nats on 2 of these 10 prompts), which is warned about, not hidden."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs, reference = {}, None
    for tp in (1, 2):
        torch.set_num_threads(1)
        llm = LLM(tensor_parallel_size=tp, speculative_config=None, max_num_seqs=16, seed=0)
        assert llm.engine.model.quantization == "gguf" and llm.engine.runner.graphs is not None
        outputs[tp] = llm.generate(PROMPTS, params, use_tqdm=False)
        if tp == 1:
            reference = llm
        else:
            llm.close()
    check_tokens_equal(
        reference.engine.model, outputs[1], outputs[2], params, "GGUF TP=2", BF16_NEAR_TIE
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"speculative_config": {"method": "draft_model", "model": "truncated:4"}},
            "a truncated draft model shares the target's layers",
        ),
    ],
)
def test_what_tp_does_not_run_is_refused_by_name(kwargs, message):
    args = {**ENGINE_ARGS, "speculative_config": None, **kwargs}
    with pytest.raises(ValueError, match=message) as info:
        LLM(tensor_parallel_size=2, **args)
    assert "\n" not in str(info.value)


def test_a_loaded_model_is_refused_under_tp():
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine

    reference = _engine(1, None)
    config = EngineConfig(tensor_parallel_size=2, quantization=None)
    with pytest.raises(ValueError, match=r"loads each rank's shard from config\.model"):
        LLMEngine(config, model=reference.engine.model, tokenizer=reference.get_tokenizer())
