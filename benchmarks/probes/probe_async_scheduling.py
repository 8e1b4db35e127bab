"""Where the asynchronous engine loop loses time on the GPU: a diagnostic, not a benchmark.

    python benchmarks/probes/probe_async_scheduling.py --out DIR [--shape llama-3.2-1b] [--batch 64]

At batch 64 on a Llama-3.2-1B shape, the overlapped loop measured 1.62-1.77 ms per step against a
1.24 ms graph replay (benchmarks/history.md, session 4), although the host work per step should fit
under the replay. This script (1) runs one generate under `torch.cuda.set_sync_debug_mode("warn")`
and lists the Python lines whose operations synchronise the device; (2) times every part of the
overlapped step on the host (schedule, launch, resolve) and the GPU time between consecutive graph
launches (CUDA events recorded right after each replay is queued); (3) writes a `torch.profiler`
trace of a few steps (DIR/trace.json) and prints its busiest host operations.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_gpu_engine

from bench_gpu_engine import build_ours, hf_config, make_llm, random_prompts


def generate(llm, prompts, tokens: int) -> None:
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()


def synchronising_calls(llm, prompts) -> list[str]:
    """Where a generate synchronises the device: (file:line, message, count) of every warning
    `torch.cuda.set_sync_debug_mode("warn")` raises, most frequent first."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate(llm, prompts, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    counts = collections.Counter(
        f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught
    )
    return [f"{count} x {where}" for where, count in counts.most_common()]


def timed_parts(llm, prompts, tokens: int) -> dict:
    """Host milliseconds per call of each part of the overlapped step, and GPU milliseconds
    between consecutive graph launches."""
    engine = llm.engine
    graphs = engine.runner.graphs
    host = collections.defaultdict(list)
    events = []

    def wrap(obj, name):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                host[name].append((time.perf_counter() - start) * 1e3)

        setattr(obj, name, timed)
        return original

    originals = {name: wrap(engine, name) for name in ("_schedule", "_launch", "_resolve", "step")}
    graph_run = graphs.run

    def run(*args, **kwargs):
        out = graph_run(*args, **kwargs)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events.append(event)
        return out

    graphs.run = run
    try:
        generate(llm, prompts, tokens)
    finally:
        graphs.run = graph_run
        for name, original in originals.items():
            setattr(engine, name, original)
    gaps = [a.elapsed_time(b) for a, b in itertools.pairwise(events)]
    summary = {name: statistics.median(v) for name, v in host.items()}
    summary["calls"] = {name: len(v) for name, v in host.items()}
    summary["gpu_ms_between_graph_launches_median"] = statistics.median(gaps) if gaps else None
    summary["gpu_ms_between_graph_launches"] = [round(g, 3) for g in gaps[:80]]
    return summary


def profile(llm, prompts, out: Path) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        generate(llm, prompts, 12)
    prof.export_chrome_trace(str(out / "trace.json"))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_ours(args.shape)
    prompts = random_prompts(args.batch, hf_config(args.shape)["vocab_size"], seed=args.batch)
    report = {}
    for mode in (True, False):
        llm = make_llm(model, async_scheduling=mode)
        generate(llm, prompts, args.tokens)  # warm-up: graphs captured
        name = "async" if mode else "sync"
        report[name] = timed_parts(llm, prompts, args.tokens)
        print(
            name,
            json.dumps(
                {k: v for k, v in report[name].items() if k != "gpu_ms_between_graph_launches"}
            ),
            flush=True,
        )
        if mode:
            report["synchronising_calls"] = synchronising_calls(llm, prompts)
            print("synchronising calls:", *report["synchronising_calls"], sep="\n", flush=True)
            table = profile(llm, prompts, out)
            (out / "profile.txt").write_text(table)
            print(table, flush=True)
        del llm
        torch.cuda.empty_cache()
    (out / "probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
