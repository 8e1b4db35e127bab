"""Which part of a speculative round on the device launches which kernels: a diagnostic, not a
benchmark.

    python benchmarks/probes/probe_round_regions.py --out DIR [--shape smollm2-135m]
        [--batches 1,8] [--k 3] [--temperature 1]

Runs device rounds (asynchronous scheduling, `enforce_eager=True`, so that every kernel of a
round is launched where the profiler sees it) of an EAGLE head with random weights on the given
shape, labels the round's parts (the head's catch-up inputs and step, each chain step, each draw,
the target's inputs and forward, verification, bookkeeping) with `record_function`, and writes
per part the kernels a round launches and their GPU time to DIR/round_regions.json and a table
to DIR/round_regions_b<batch>.txt. Only kernels inside a round are counted (not the prefill or
the synchronous first step). On a machine without CUDA it counts the parts' PyTorch operations
instead (the CPU twins', which differ from the kernels).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

ROUND = "round"
LABELS = {ROUND, "head: catch_up", "head: chain", "target: forward"}  # and those of `label`


def label(owner, name: str, text: str) -> None:
    """Wraps owner.name so that what it runs is profiled under `text`."""
    original = getattr(owner, name)
    LABELS.add(text)

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(text):
            return original(*args, **kwargs)

    setattr(owner, name, labelled)


def install_labels() -> None:
    import specdec.drafters.base as base
    import specdec.drafters.eagle.device as eagle_device
    import specdec.drafters.eagle.head_graphs as head_graphs
    import specdec.engine.device_round as device_round

    label(device_round.DeviceRounds, "_round", ROUND)
    label(device_round, "round_inputs", "round inputs")
    label(device_round, "finish_round", "finish round")
    label(device_round, "check_verify_inputs", "verify: inputs")
    label(device_round, "verify_checked", "verify")
    label(eagle_device.EagleDeviceDrafting, "propose", "propose (its own ops)")
    label(eagle_device.EagleDeviceDrafting, "_round_inputs", "head round inputs")
    label(eagle_device.EagleDeviceDrafting, "observe", "observe")
    label(base.Drafter, "draw_on_device", "draw")
    label(base.Drafter, "to_target_vocab", "draw: to target vocab")
    graphs = head_graphs.HeadGraphs
    original = graphs.forward

    def head_forward(self, kind, num_seqs, chain=None):
        with torch.profiler.record_function(f"head: {kind}"):
            return original(self, kind, num_seqs, chain)

    graphs.forward = head_forward


def label_target(llm) -> None:
    graphs = llm.engine.runner.graphs
    original = graphs.forward

    def forward(*args, **kwargs):
        with torch.profiler.record_function("target: forward"):
            return original(*args, **kwargs)

    graphs.forward = forward


def regions(prof, on_cuda: bool) -> dict[str, dict[str, float]]:
    """Per innermost label inside a round: kernels (CUDA) or operations (CPU), their GPU time
    in us, and the most frequent names."""
    count = collections.Counter()
    micros = collections.Counter()
    names: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in prof.events():
        if on_cuda:
            launched = [(k.name, k.duration) for k in getattr(event, "kernels", [])]
        else:
            launched = [(event.name, 0.0)] if event.name.startswith("aten::") else []
            if any(c.name.startswith("aten::") for c in event.cpu_children):
                launched = []  # count the innermost operations only
        if not launched:
            continue
        parent, region, in_round = event.cpu_parent, None, False
        while parent is not None:
            if region is None and parent.name in LABELS and parent.name != ROUND:
                region = parent.name
            if parent.name == ROUND:
                in_round = True
                break
            parent = parent.cpu_parent
        if not in_round:
            continue
        region = region or "round (its own ops)"
        for name, duration in launched:
            count[region] += 1
            micros[region] += duration
            names[region][name[:60]] += 1
    return {
        region: {"launches": count[region], "us": micros[region], "names": dict(names[region])}
        for region in count
    }


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench_gpu_engine import build_ours, make_llm, random_prompts
    from probe_spec_step import random_eagle_head
    from specdec.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_cuda = torch.cuda.is_available()
    install_labels()
    model = build_ours(args.shape, "cuda" if on_cuda else "cpu")
    head = random_eagle_head(model, out / "random_eagle_head")
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": args.k, "adaptive": False}
    report = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        llm = make_llm(
            model, spec, max_num_seqs=max(batch, 8), enforce_eager=True, async_scheduling=True
        )
        prompts = random_prompts(batch, model.config.vocab_size, seed=batch)
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, seed=1
        )
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels compiled
        label_target(llm)  # (the runner's decode path exists from the first decode step on)
        before = llm.engine.loop_stats.num_device_rounds
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        rounds = max(llm.engine.loop_stats.num_device_rounds - before, 1)
        found = regions(prof, on_cuda)
        total = sum(r["launches"] for r in found.values())
        micros = sum(r["us"] for r in found.values())
        unit = "kernels" if on_cuda else "operations"
        lines = [
            f"batch {batch}, K {args.k}, T {args.temperature}: {rounds} rounds; per round "
            f"{total / rounds:.1f} {unit}, {micros / rounds:.1f} us of GPU time"
        ]
        for region, r in sorted(found.items(), key=lambda kv: -kv[1]["launches"]):
            top = sorted(r["names"].items(), key=lambda kv: -kv[1])[:8]
            lines.append(
                f"{r['launches'] / rounds:7.1f} {unit} {r['us'] / rounds:8.1f} us  {region}: "
                + ", ".join(f"{name} x{n / rounds:.1f}" for name, n in top)
            )
        table = "\n".join(lines)
        print(table, flush=True)
        (out / f"round_regions_b{batch}.txt").write_text(table + "\n")
        report[str(batch)] = {"rounds": rounds, "regions": found}
        del llm
    (out / "round_regions.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
