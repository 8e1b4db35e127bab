"""What one speculative round on the device spends its GPU time on: a diagnostic, not a benchmark.

    python benchmarks/probes/probe_round_kernels.py --out DIR [--shape smollm2-135m] [--batch 1]

Runs device rounds (asynchronous scheduling) with `enforce_eager=True`, so that every kernel of
the round shows in a `torch.profiler` trace, for an EAGLE head with random weights on the given
shape (K = 3) and for the oracle drafter (K = 4); writes the kernels of the rounds by total GPU
time (per round) and their count to DIR/round_kernels_<drafter>.txt and DIR/round_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu_engine import build_ours, make_llm, random_prompts
from oracle_drafter import OracleDrafter
from probe_spec_step import random_eagle_head


def census(llm, prompts, tokens: int) -> tuple[str, dict]:
    from torch.profiler import ProfilerActivity, profile

    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=1)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels compiled
    before = llm.engine.loop_stats.num_device_rounds
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    rounds = max(llm.engine.loop_stats.num_device_rounds - before, 1)
    kernels = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0)
        if cuda_us and event.count and not event.key.startswith(("aten::", "cuda", "Memcpy")):
            kernels[event.key] = {
                "us_per_round": cuda_us / rounds,
                "launches_per_round": event.count / rounds,
            }
    total = sum(k["us_per_round"] for k in kernels.values())
    launches = sum(k["launches_per_round"] for k in kernels.values())
    lines = [f"rounds {rounds}; GPU {total:.1f} us and {launches:.0f} kernels per round"]
    for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_round"])[:40]:
        lines.append(f"{k['us_per_round']:9.1f} us {k['launches_per_round']:6.1f}x  {name[:110]}")
    summary = {"rounds": rounds, "us_per_round": total, "kernels_per_round": launches}
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_ours(args.shape)
    prompts = random_prompts(args.batch, model.config.vocab_size, seed=args.batch)
    report = {}
    head = random_eagle_head(model, out / "random_eagle_head")
    for name, spec in (
        ("eagle3", {"method": "eagle", "model": head, "num_speculative_tokens": 3}),
        ("oracle4", {"method": "ngram", "num_speculative_tokens": 4}),
    ):
        llm = make_llm(model, {**spec, "adaptive": False}, max_num_seqs=8, enforce_eager=True)
        if name.startswith("oracle"):
            sequences = [p + [5] * (args.tokens + 8) for p in prompts]
            llm.engine.drafter = OracleDrafter(model.config.vocab_size, 0.8, sequences, 16)
        table, summary = census(llm, prompts, args.tokens)
        (out / f"round_kernels_{name}.txt").write_text(table)
        report[name] = summary
        print(name, table, sep="\n", flush=True)
        del llm
    (out / "round_kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
