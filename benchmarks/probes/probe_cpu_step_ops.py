"""Where a CPU step's time goes, ATen operation by operation: the built-in model (GGUF kept
quantized), one 64-token greedy generate after a warm one, under `torch.profiler` (the
operations inside the C++ layer loop are recorded too); per operation, calls and self
milliseconds a step. `plain`, or K (the shipped head pinned at K drafts a step).

    PYTHONPATH=src python benchmarks/probes/probe_cpu_step_ops.py plain|1|2 [--threads 2]

A profile (the profiler's own overhead included), not a BENCHMARKS.md figure by itself.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", help="plain, or K (drafts a step, pinned)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.drafters.default import DEFAULT_EAGLE_DIR

    spec = None
    if args.mode != "plain":
        spec = {
            "method": "eagle",
            "model": str(DEFAULT_EAGLE_DIR),
            "num_speculative_tokens": int(args.mode),
            "adaptive": False,
        }
    llm = LLM(speculative_config=spec)
    chat = [{"role": "user", "content": "Tell me about the history of Rome."}]
    prompt = [{"prompt_token_ids": llm.tokenizer.encode_chat(chat)}]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, seed=1)
    llm.generate(prompt, params, use_tqdm=False)  # warm
    before = llm.engine.loop_stats.num_sync_steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
    steps = llm.engine.loop_stats.num_sync_steps - before
    print("steps", steps)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
    for e in events:
        per_step = e.self_cpu_time_total / 1000 / steps
        print(f"{e.key[:60]:60s} calls/step {e.count / steps:7.1f}  self ms/step {per_step:7.3f}")


if __name__ == "__main__":
    main()
