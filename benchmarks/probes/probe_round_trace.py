"""Where the GPU waits between device rounds: a profiler timeline of the round loop.

`probe_round_costs.py` found a K = 2 round at batch 32 costing 1.42 ms between launches while
its graph replays in 1.24 ms alone (H200, 2026-12-01; the plain step: 0.95 against 0.96): the
GPU idles ~0.17 ms per round. This probe profiles one generate call (CPU and CUDA activity,
after warm-up calls), labels the host's parts of the loop (`record_function`), and reads the
timeline: the GPU's busy intervals (kernels and copies), the gaps between them longer than
`--min-gap-us`, and for each gap the innermost labelled host part running when the gap began
and when it ended (what the host was doing while the GPU had nothing queued).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_round_trace.py --out DIR \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--batch 32] [--k 2]

Writes DIR/round_trace.json (gap statistics by host part) and DIR/trace_<name>.json.gz (the
chrome trace). A profile, not a BENCHMARKS.md figure.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_spec_round import load_smollm2, make_engine, smollm2_batch  # noqa: E402

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def label(obj, name: str, text: str) -> None:
    """Wraps obj.name in a profiler range called `text`."""
    inner = getattr(obj, name)

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(text):
            return inner(*args, **kwargs)

    setattr(obj, name, labelled)


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATEGORIES
    )
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def innermost(ranges: list[tuple[float, float, str]], t: float) -> str:
    """The shortest labelled host range containing time t ("-" when none)."""
    best, width = "-", float("inf")
    for start, end, name in ranges:
        if start <= t <= end and end - start < width:
            best, width = name, end - start
    return best


def analyse(trace_path: Path, min_gap_us: float) -> dict:
    events = json.loads(trace_path.read_text())["traceEvents"]
    busy = busy_intervals(events)
    ranges = [
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("sd.")
    ]
    loop = [r for r in ranges if r[2] == "sd.step"]
    if not busy or not loop:
        return {"error": "no GPU activity or no labelled steps in the trace"}
    first, last = loop[0][0], loop[-1][1]
    gaps = []
    for (_, end), (start, _) in itertools.pairwise(busy):
        if start - end >= min_gap_us and first <= end <= last:
            gaps.append((end, start))
    by_start: dict[str, list[float]] = defaultdict(list)
    by_end: dict[str, list[float]] = defaultdict(list)
    for end, start in gaps:
        by_start[innermost(ranges, end)].append(start - end)
        by_end[innermost(ranges, start)].append(start - end)
    busy_in_loop = sum(
        min(b, last) - max(a, first) for a, b in busy if b > first and a < last
    )  # fmt: skip
    return {
        "loop_us": last - first,
        "gpu_busy_us": busy_in_loop,
        "gap_count": len(gaps),
        "gap_total_us": sum(s - e for e, s in gaps),
        "gaps_by_host_part_at_gap_start": {
            k: {"count": len(v), "total_us": round(sum(v), 1)} for k, v in by_start.items()
        },
        "gaps_by_host_part_at_gap_end": {
            k: {"count": len(v), "total_us": round(sum(v), 1)} for k, v in by_end.items()
        },
        "steps": len(loop),
        "host_parts_total_us": {
            name: round(sum(e - s for s, e, n in ranges if n == name), 1)
            for name in sorted({r[2] for r in ranges})
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-gap-us", type=float, default=10.0)
    args = parser.parse_args()
    model, tokenizer, encoded, head = load_smollm2(args.gguf, "cuda")
    batch = args.batch
    prompts, blocks, params = smollm2_batch(encoded, batch, args.output_len, 0.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, spec in (
        ("plain", None),
        (f"K={args.k}", {**head, "num_speculative_tokens": args.k, "adaptive": False}),
    ):
        llm = make_engine(
            model, tokenizer, spec, device="cuda", max_num_seqs=batch, max_model_len=1024,
            blocks=blocks,
        )  # fmt: skip
        engine = llm.engine
        for _ in range(3):
            llm.generate(prompts, params, use_tqdm=False)
        label(engine, "step", "sd.step")
        label(engine, "_commit", "sd.commit")
        for attr in ("_launch", "_resolve", "_schedule"):
            if hasattr(engine, attr):
                label(engine, attr, f"sd.{attr.strip('_')}")
        if engine._rounds is not None:
            rounds = engine._rounds
            label(rounds, "launch", "sd.rounds.launch")
            label(rounds, "read", "sd.rounds.read")
            label(rounds, "launch_room", "sd.rounds.launch_room")
            label(rounds.drafting, "prepare", "sd.drafting.prepare")
            label(rounds.inputs, "begin", "sd.inputs.begin")
            label(rounds.inputs, "send", "sd.inputs.send")
            label(rounds.graph_cache, "run", "sd.graph.run")
            label(engine.policy, "choose", "sd.policy.choose")
            label(engine.policy, "observe", "sd.policy.observe")
            label(engine, "_grow_ahead", "sd.grow_ahead")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        trace = out / f"trace_{name.replace('=', '')}.json"
        prof.export_chrome_trace(str(trace))
        results[name] = analyse(trace, args.min_gap_us)
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            packed.write(raw.read())
        trace.unlink()
        print(f"[trace] {name}: {json.dumps(results[name])}", flush=True)
        del llm, engine
        torch.cuda.empty_cache()
    (out / "round_trace.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'round_trace.json'}")


if __name__ == "__main__":
    main()
