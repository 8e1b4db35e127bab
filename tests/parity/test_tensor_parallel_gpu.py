"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs on): the CPU tests' equalities on the built-in
SmolLM2. Skipped without 2 CUDA devices.

- float32 (the GGUF blocks dequantized): prompt logits of TP = 2 within LOGITS_ATOL of TP = 1
  (through the engine's graphed decode path: the greedy tokens of a graphed TP = 2 engine equal
  TP = 1's except at detected near-ties, speculation (EAGLE head, n-gram) on and off, seeded
  sampling too);
- bfloat16 (the CUDA default): the same token equalities with a wider near-tie margin;
- with async_scheduling=True: overlapped plain decoding and device rounds equal TP = 1 too;
- a worker killed between steps fails the engine naming rank 1 within seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.runner.tensor_parallel import WorkerDiedError
from tensor_parallel_fixtures import PROMPTS, check_tokens_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# bfloat16 logits round to ~0.1 at magnitude 30: a split of the sums may flip ties that close.
BF16_NEAR_TIE = 0.5
# `check_tokens_equal` judges a sampled token by the plain sampler's rule (logits / T + Gumbel
# noise), which is how `coupled` verification emits it. `standard` accepts a draft when
# u < p / q, a comparison that bfloat16's TP = 2 sums flip unseen by that rule (s18, TP = 2 over
# gloo on one H200: a flip at a top-2 margin of 1.06), so bfloat16 runs verify with `coupled`;
# `standard` is compared in float32, where the two splits' logits differ by ~1e-4.
BF16_SPEC = {"rejection_sample_method": "coupled"}


def _engine(tp: int, dtype: str, spec, async_scheduling: bool = False) -> LLM:
    return LLM(
        tensor_parallel_size=tp,
        dtype=dtype,
        device="cuda",
        speculative_config=spec,
        quantization=None,
        max_num_seqs=16,
        max_model_len=512,
        # Explicit: TP = 1 and TP = 2's driver share GPU 0 (a cache sized from free memory
        # would leave the second nothing), and both take the synchronous step (TP = 2 has no
        # overlapped one), so the two runs differ only by the split.
        num_kv_blocks=1024,
        async_scheduling=async_scheduling,
        seed=0,
    )


@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_overlapped_and_device_rounds_tp2_match_tp1(method):
    """async_scheduling=True on NCCL with CUDA graphs: overlapped plain decoding (speculation
    off) and device rounds (K pinned: the round's target step replayed from a graph on the
    driver, its inputs broadcast to the worker) emit TP = 1's tokens but at near-ties."""
    spec = {"method": method, "num_speculative_tokens": 2, "adaptive": False, **BF16_SPEC}
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=1234)
    results = {}
    for tp in (1, 2):
        llm = _engine(tp, "bfloat16", spec, async_scheduling=True)
        runs = {}
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            for enabled in (True, False):
                runs[name, enabled] = llm.generate(
                    PROMPTS, params, speculative={"enabled": enabled}, use_tqdm=False
                )
        loop = llm.get_metrics()["loop"]
        assert loop["num_device_rounds"] > 0 and loop["num_overlapped_steps"] > 0, loop
        if tp == 1:
            reference = llm
        else:
            llm.close()
        results[tp] = runs
    for (name, enabled), outputs_1 in results[1].items():
        params = greedy if name == "greedy" else sampled
        what = f"async {method} {name} speculation {'on' if enabled else 'off'}"
        check_tokens_equal(
            reference.engine.model, outputs_1, results[2][name, enabled], params, what,
            BF16_NEAR_TIE,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "method"), [("float32", "eagle"), ("bfloat16", "eagle"), ("bfloat16", "ngram")]
)
def test_graphed_tp2_tokens_match_tp1(dtype, method):
    spec = {"method": "eagle"} if method == "eagle" else {"method": "ngram"}
    if method == "ngram":
        spec["num_speculative_tokens"] = 3
    if dtype == "bfloat16":
        spec.update(BF16_SPEC)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=1234)
    near_tie = 4e-3 if dtype == "float32" else BF16_NEAR_TIE
    results = {}
    for tp in (1, 2):
        llm = _engine(tp, dtype, spec)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.use_graphs
        runs = {}
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            for enabled in (True, False):
                runs[name, enabled] = llm.generate(
                    PROMPTS, params, speculative={"enabled": enabled}, use_tqdm=False
                )
        if tp == 1:
            reference = llm
        else:
            llm.close()
        results[tp] = runs
    ties = 0
    for (name, enabled), outputs_1 in results[1].items():
        params = greedy if name == "greedy" else sampled
        what = f"{dtype} {method} {name} speculation {'on' if enabled else 'off'}"
        ties += check_tokens_equal(
            reference.engine.model, outputs_1, results[2][name, enabled], params, what, near_tie
        )
    print(f"{dtype} {method}: {ties} near-ties in {4 * len(PROMPTS)} sequences")


def test_killed_worker_fails_with_its_rank_on_nccl():
    llm = _engine(2, "bfloat16", None)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    worker = llm.engine.runner._group.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert time.monotonic() - started < 10
