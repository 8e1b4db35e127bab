"""Tensor parallelism's GPU code on the one GPU a single-GPU machine has: a diagnostic, not a
benchmark, for when no multi-GPU machine is lent (issue 20). Two parts, one process each:

    python benchmarks/probes/probe_tp_one_gpu.py --part nccl-graphs --model GGUF --out A.json
    python benchmarks/probes/probe_tp_one_gpu.py --part gloo-split --model GGUF --out B.json

- `nccl-graphs`: the tensor-parallel driver path with an NCCL group of one rank (the engine is
  asked for TP = 2; `start_target` is redirected to a world of 1, so there are no workers): the
  sharded model's all-reduces and vocabulary gather are real NCCL calls, captured in the decode
  and round CUDA graphs. Its tokens are compared with a plain TP = 1 engine (they should be
  identical: one rank's sums are the whole sums), and both are timed (what NCCL's kernels add to
  a graphed step of one rank).
- `gloo-split`: TP = 2 with both ranks on cuda:0 over gloo (NCCL refuses two ranks on one
  device, and gloo's collectives cannot be captured: enforce_eager). The real 2-way split of
  heads, MLP and vocabulary on CUDA tensors, tokens compared with TP = 1 (same settings) except
  at detected near-ties.

The redirections are monkeypatches made at import (so spawned workers, which import this file
as `__mp_main__`, get them too); nothing in `src/` changes. Results: one JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import specdec.engine.llm_engine as llm_engine
import specdec.engine.setup as engine_setup
import specdec.runner.tensor_parallel as tp_runner
from specdec.models.tensor_parallel import Collectives
from tensor_parallel_fixtures import PROMPTS

PART = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--part=")), None)
if PART is None and "--part" in sys.argv:
    PART = sys.argv[sys.argv.index("--part") + 1]

engine_setup.check_gpu_count = lambda size, device: None  # one GPU stands in for N
_real_start_target = tp_runner.start_target
if PART == "nccl-graphs":
    llm_engine.start_target = lambda path, dtype, device, quant, size: _real_start_target(
        path, dtype, device, quant, 1
    )
elif PART == "gloo-split":
    tp_runner.backend_for = lambda device: "gloo"
    tp_runner._device_of = lambda device, rank: torch.device(
        "cuda:0" if device == "cuda" else device
    )

CALLS = {"all_reduce": 0, "gather_vocab": 0}
_all_reduce, _gather = Collectives.all_reduce, Collectives.gather_vocab


def _counted_all_reduce(self, x):
    CALLS["all_reduce"] += 1
    return _all_reduce(self, x)


def _counted_gather(self, logits):
    CALLS["gather_vocab"] += 1
    return _gather(self, logits)


Collectives.all_reduce, Collectives.gather_vocab = _counted_all_reduce, _counted_gather

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run of the flow
HEAD = "src/specdec/drafters/default/smollm2-135m-instruct-eagle"


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _runs(llm, params_by_name, spec_states):
    runs, seconds = {}, {}
    for name, params in params_by_name.items():
        for enabled in spec_states:
            _sync()
            start = time.perf_counter()
            outputs = llm.generate(
                PROMPTS, params, speculative={"enabled": enabled}, use_tqdm=False
            )
            _sync()
            seconds[f"{name} spec={enabled}"] = time.perf_counter() - start
            runs[name, enabled] = outputs
    return runs, seconds


def nccl_graphs(model: str) -> dict:
    from specdec import LLM, SamplingParams

    params = {
        "greedy": SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
        "sampled": SamplingParams(max_tokens=64, temperature=0.8, seed=1234, ignore_eos=True),
    }
    spec = {"method": "eagle", "model": HEAD, "num_speculative_tokens": 3, "adaptive": False}
    result = {}
    engines = {}
    for name, tp in (("tp1", 1), ("nccl_world1", 2)):
        CALLS.update(all_reduce=0, gather_vocab=0)
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            device=DEVICE,
            dtype="bfloat16",
            speculative_config=spec,
            max_num_seqs=16,
            max_model_len=512,
            num_kv_blocks=1024,
            async_scheduling=True,
            seed=0,
        )
        graphs = llm.engine.runner.graphs
        _runs(llm, params, (True, False))  # warm-up: captures the graphs
        calls_warm = dict(CALLS)
        runs, seconds = _runs(llm, params, (True, False))
        loop = llm.get_metrics()["loop"]
        group = llm.engine.tensor_parallel
        result[name] = {
            "use_graphs": bool(graphs is not None and graphs.use_graphs),
            "backend": torch.distributed.get_backend() if group is not None else None,
            "world_size": torch.distributed.get_world_size() if group is not None else 1,
            "collective_calls_while_warming": calls_warm,
            "collective_calls_timed_runs": {k: CALLS[k] - calls_warm[k] for k in CALLS},
            "num_device_rounds": loop.get("num_device_rounds"),
            "num_overlapped_steps": loop.get("num_overlapped_steps"),
            "seconds_10_prompts_x_64_tokens": seconds,
        }
        engines[name] = (llm, runs)
        if name == "tp1":
            continue
        llm.close()
    runs_1, runs_n = engines["tp1"][1], engines["nccl_world1"][1]
    result["tokens_equal"] = {
        f"{n} spec={e}": _tokens(runs_1[n, e]) == _tokens(runs_n[n, e]) for n, e in runs_1
    }
    return result


def gloo_split(model: str) -> dict:
    from specdec import LLM, SamplingParams
    from tensor_parallel_fixtures import check_tokens_equal

    params = {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0),
        "sampled": SamplingParams(max_tokens=24, temperature=0.8, seed=1234),
    }
    result = {}
    # The near-tie check judges a sampled token by the plain sampler's rule (logits / T + the
    # target's Gumbel noise): that is how `coupled` verification emits it, not `standard`'s
    # (u < p / q, then the residual), whose flips it cannot see.
    settings = [
        ("float32", 4e-3, False, "standard"),
        ("float32", 4e-3, True, "standard"),
        ("bfloat16", 0.5, False, "standard"),
        ("bfloat16", 0.5, False, "coupled"),
        ("bfloat16", 0.5, True, "coupled"),
    ]
    for dtype, near_tie, async_scheduling, method in settings:
        spec = {"method": "eagle", "model": HEAD, "num_speculative_tokens": 2}
        spec.update(adaptive=False, rejection_sample_method=method)
        runs = {}
        reference = None
        key = f"{dtype} async={async_scheduling} {method}"
        try:
            for tp in (1, 2):
                llm = LLM(
                    model,
                    tensor_parallel_size=tp,
                    device=DEVICE,
                    dtype=dtype,
                    quantization=None,
                    speculative_config=spec,
                    enforce_eager=True,
                    max_num_seqs=16,
                    max_model_len=512,
                    num_kv_blocks=1024,
                    async_scheduling=async_scheduling,
                    seed=0,
                )
                runs[tp], seconds = _runs(llm, params, (True, False))
                loop = llm.get_metrics()["loop"]
                result[f"{key} tp={tp}"] = {
                    "seconds": seconds,
                    "num_device_rounds": loop.get("num_device_rounds"),
                }
                if tp == 1:
                    reference = llm
                else:
                    llm.close()
            ties = 0
            for (name, enabled), outputs_1 in runs[1].items():
                ties += check_tokens_equal(
                    reference.engine.model,
                    outputs_1,
                    runs[2][name, enabled],
                    params[name],
                    f"{key} {name} spec={enabled}",
                    near_tie,
                )
            result[key] = {"equal_but_near_ties": True, "near_ties": ties}
        except Exception as err:  # reported, not hidden: the JSON says what failed
            result[key] = {"error": f"{type(err).__name__}: {err}"}
        del reference
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", required=True, choices=("nccl-graphs", "gloo-split"))
    parser.add_argument("--model", required=True, help="the SmolLM2 GGUF (or any Llama model)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    result = nccl_graphs(args.model) if args.part == "nccl-graphs" else gloo_split(args.model)
    result["part"] = args.part
    result["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result["torch"] = torch.__version__
    result["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
