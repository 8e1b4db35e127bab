"""Probe: where a batch-1 decode token of the default CPU engine goes (the built-in SmolLM2 GGUF,
kept quantized): TPOT, then one profiled generation's operators per token by self CPU time.

    python benchmarks/probes/probe_cpu_decode_ops.py [--threads 2] [--tokens 48] > FILE.txt

Never imported by tests.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    llm = LLM(speculative_config=None)
    ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
    tokens = args.tokens
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(ids, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(ids, one, use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(ids, params, use_tqdm=False)
    whole = time.perf_counter() - start
    print(f"TPOT {(whole - first) / (tokens - 1) * 1e3:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(ids, params, use_tqdm=False)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    count = sum(e.count for e in events)
    print(
        f"events per token: {count / tokens:.0f}; self CPU per token {total / tokens / 1e3:.2f} ms"
    )
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        ms = event.self_cpu_time_total / tokens / 1e3
        print(f"  {event.key[:50]:50s} {ms:7.3f} ms/token  calls/token {event.count / tokens:6.1f}")


if __name__ == "__main__":
    main()
