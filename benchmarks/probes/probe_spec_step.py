"""Where a speculative engine step spends its time on the GPU: a diagnostic, not a benchmark.

    python benchmarks/probes/probe_spec_step.py --out DIR [--shape llama-3.2-1b] [--batch 1]

With random weights on a Llama-3.2-1B shape, a draft model made of the target's first 2 layers
(K = 4) took 7.7 ms per token against 1.9 ms for plain decoding (benchmarks/history.md, machine A),
and the SmolLM2 EAGLE head ran at 0.15-0.24x plain decoding on the H200. This script times the host
side of each part of one speculative step (propose, the target's forward, verify and commit), lists
the lines that synchronise the device, and writes the busiest host operations of a `torch.profiler`
run to DIR/spec_profile.txt, for the draft model and for n-gram drafting.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/: probe_async_scheduling
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_gpu_engine

from bench_gpu_engine import build_ours, make_llm, random_prompts
from probe_async_scheduling import generate, synchronising_calls

SPECS = {
    "draft_model": {"method": "draft_model", "model": "truncated:2", "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    # EAGLE heads with random weights (speed only): K = 2 and 4.
    "eagle2": {"method": "eagle", "num_speculative_tokens": 2},
    "eagle4": {"method": "eagle", "num_speculative_tokens": 4},
}


def random_eagle_head(model, out: Path, draft_vocab: int = 16384) -> str:
    """Writes an EAGLE head directory for `model` with random weights (shaped like the shipped
    SmolLM2 head: features of three layers, a reduced draft vocabulary)."""
    from safetensors.torch import save_file

    from specdec.drafters.eagle.head import EagleConfig, EagleHead

    layers = model.config.num_hidden_layers
    config = EagleConfig.for_target(
        model.config,
        feature_layers=tuple(sorted({min(2, layers - 1), layers // 2, layers - 1})),
        draft_vocab_size=draft_vocab,
    )
    head = EagleHead(config)
    tensors = {}
    for name, param in head.named_parameters():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(param.shape)
        else:
            tensors[name] = torch.randn(param.shape) * 0.02
    tensors["draft_to_target"] = torch.randperm(model.config.vocab_size)[:draft_vocab]
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    return str(out)


# The parts of a synchronous step, as the step loop calls them: engine methods, the step's
# module functions (looked up in specdec.engine.llm_engine's namespace) and the emitter.
ENGINE_PARTS = ("_schedule", "step")
LOOP_FUNCTIONS = ("propose", "step_inputs", "deliver_features")


def timed_parts(llm, prompts, tokens: int) -> dict:
    """Median host milliseconds per call of each part of the synchronous step, and of the
    drafter's `propose`."""
    from specdec.engine import llm_engine

    engine = llm.engine
    host = collections.defaultdict(list)
    targets = [(engine, name, name) for name in ENGINE_PARTS]
    targets += [(llm_engine, name, name) for name in LOOP_FUNCTIONS]
    targets += [(engine.emitter, "emit", "emit"), (engine.runner, "run_with_features", "run")]
    targets += [(engine.drafter, "propose", "drafter.propose")]
    originals = []
    for obj, name, label in targets:
        original = getattr(obj, name)

        def timed(*args, _original=original, _name=label, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                host[_name].append((time.perf_counter() - start) * 1e3)

        setattr(obj, name, timed)
        originals.append((obj, name, original))
    try:
        generate(llm, prompts, tokens)
    finally:
        for obj, name, original in originals:
            if obj is llm_engine:
                setattr(obj, name, original)
            else:
                delattr(obj, name)  # the instance attribute hid the class's method
    summary = {name: round(statistics.median(v), 3) for name, v in host.items()}
    summary["calls"] = {name: len(v) for name, v in host.items()}
    return summary


def profile(llm, prompts) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(llm, prompts, 16)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--specs", default="draft_model,ngram")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_ours(args.shape)
    prompts = random_prompts(args.batch, model.config.vocab_size, seed=args.batch)
    report = {}
    head_dir = None
    for name in args.specs.split(","):
        spec = SPECS.get(name)
        if name.startswith("eagle"):
            head_dir = head_dir or random_eagle_head(model, out / "random_eagle_head")
            spec = {**spec, "model": head_dir}
        llm = make_llm(model, spec, max_num_seqs=8)
        if spec is None:  # plain decoding, the default loop, for comparison
            generate(llm, prompts, args.tokens)
            torch.cuda.synchronize()
            start = time.perf_counter()
            generate(llm, prompts, args.tokens)
            report[name] = {"ms_per_generate": round((time.perf_counter() - start) * 1e3, 2)}
            print(name, json.dumps(report[name]), flush=True)
            continue
        generate(llm, prompts, args.tokens)  # warm-up: kernels compiled, graphs captured
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(llm, prompts, args.tokens)
        wall = (time.perf_counter() - start) * 1e3
        report[name] = {"ms_per_generate": round(wall, 2), **timed_parts(llm, prompts, args.tokens)}
        print(name, json.dumps(report[name]), flush=True)
        report[name]["synchronising_calls"] = synchronising_calls(llm, prompts)
        print("synchronising calls:", *report[name]["synchronising_calls"], sep="\n", flush=True)
        table = profile(llm, prompts)
        (out / f"spec_profile_{name}.txt").write_text(table)
        print(table, flush=True)
        del llm
        torch.cuda.empty_cache()
    (out / "spec_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
