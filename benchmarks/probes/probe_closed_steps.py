"""Where a closed batch of the built-in model spends its time, spec against plain (issue 34: the
server at c = 16 ran at 0.48x plain, the closed batch at max_num_seqs 16 at 0.81x; H200, s27).

For each max_num_seqs in `--batches`, an engine with the default speculation and one without
(the built-in GGUF on CUDA, both warmed up as `specdec serve` warms up) run the same `--requests`
seeded chats (the built-in prompts, 128 tokens, T = 0.8, EOS ignored) `--runs` times; after each
run: seconds, tokens/s, the loop counters grown, CUDA graphs captured and Triton variants
compiled after the warm-up. Then, on the speculative engine, one more run with each engine part
timed between `torch.cuda.synchronize()` calls (synchronous steps, drafting, device-round entry,
launch, read, exit): calls, total ms, ms a call (the synchronisation itself slows the run: a
profile, not a figure).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_closed_steps.py --gguf GGUF \
        --out DIR [--batches 16,64] [--requests 64] [--runs 2]

Writes DIR/closed_steps.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specdec.bench_serve.client import prompt  # noqa: E402


def timed_parts():
    """Wraps the engine's parts with synchronised host clocks; returns (totals, counts, undo)."""
    from specdec.engine import device_round, llm_engine, speculative_loops

    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    undo = []

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                totals[label] += time.perf_counter() - start
                counts[label] += 1

        setattr(owner, name, timed)
        undo.append((owner, name, inner))

    wrap(llm_engine.LLMEngine, "_run_step", "sync step")
    wrap(llm_engine.LLMEngine, "_schedule", "schedule")
    wrap(llm_engine, "propose", "sync step: drafting")
    wrap(speculative_loops.SpeculativeLoops, "_leave_rounds", "leave rounds")
    for name in ("begin", "launch", "read", "end"):
        wrap(device_round.DeviceRounds, name, f"rounds.{name}")

    def restore():
        for owner, name, inner in reversed(undo):
            setattr(owner, name, inner)

    return totals, counts, restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    from specdec import LLM, SamplingParams

    chats = [[{"role": "user", "content": prompt(i)}] for i in range(args.requests)]
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(args.requests)
    ]
    tokens = args.requests * args.max_tokens
    result: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name(),
        }
    }
    for batch in [int(b) for b in args.batches.split(",")]:
        for spec in ("auto", None):
            mode = "spec" if spec else "plain"
            llm = LLM(model=args.gguf, device="cuda", max_num_seqs=batch, speculative_config=spec)
            llm.engine.warm_up(progress=False)
            runs = []
            before = llm.get_metrics()["loop"]
            for _ in range(args.runs):
                start = time.perf_counter()
                llm.chat(chats, params, use_tqdm=False)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                loop = llm.get_metrics()["loop"]
                grown = {
                    k: v - before.get(k, 0)
                    for k, v in loop.items()
                    if isinstance(v, int) and v - before.get(k, 0)
                }
                runs.append(
                    {
                        "s": round(seconds, 3),
                        "tok_s": round(tokens / seconds),
                        "counters": grown,
                        "k_chosen": loop["k_chosen"],
                        "graphs_after_warm_up": loop["graphs_after_warm_up"],
                        "triton_compiles_after_warm_up": loop["triton_compiles_after_warm_up"],
                    }
                )
                before = loop
                print(f"[closed] b{batch} {mode}: {json.dumps(runs[-1])}", flush=True)
            entry = {"runs": runs}
            if spec:
                totals, counts, restore = timed_parts()
                try:
                    start = time.perf_counter()
                    llm.chat(chats, params, use_tqdm=False)
                    entry["timed_run_s"] = round(time.perf_counter() - start, 3)
                finally:
                    restore()
                entry["parts"] = {
                    k: [counts[k], round(totals[k] * 1e3, 1), round(totals[k] * 1e3 / counts[k], 2)]
                    for k in sorted(totals)
                }
                print(f"[closed] b{batch} spec, parts timed ({entry['timed_run_s']} s):")
                for k, v in entry["parts"].items():
                    print(f"   {k:>22}: {v[0]:5d} calls {v[1]:9.1f} ms {v[2]:7.2f} ms a call")
            result[f"b{batch} {mode}"] = entry
            del llm
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "closed_steps.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
