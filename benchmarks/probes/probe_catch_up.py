"""What a drafted step pays for the EAGLE head's catch-up: continuous batching with the default
speculation (64 held-out chats through `max_num_seqs` slots, T = 0.8), every `propose` timed
with the longest backlog of target features it had to feed the head first (the head is fed
lazily: a stretch of K = 0 steps leaves a backlog that the next drafted step catches up on);
with the policy's choices in order (bucket, K, closed batch) and its estimates at the end.

`PYTHONPATH=src python3 benchmarks/probes/probe_catch_up.py --out FILE.json [--device cpu]
[--max-num-seqs 8] [--max-tokens 64] [--threads 2]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "heldout_prompts.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.drafters.eagle.drafter import EagleDrafter
    from specdec.engine.spec_policy import SpeculationPolicy

    calls: list[tuple[int, float]] = []  # (longest backlog, seconds) per propose
    propose = EagleDrafter.propose

    def timed(self, batch):
        backlog = [
            sum(rows.shape[0] for rows in state.pending)
            for request_id in batch.request_ids or []
            if (state := self._states.get(request_id)) is not None
        ]
        start = time.perf_counter()
        out = propose(self, batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        calls.append((max(backlog, default=0), time.perf_counter() - start))
        return out

    EagleDrafter.propose = timed
    choices: list[list] = []  # (bucket, K, closed batch) per choice of the policy
    choose = SpeculationPolicy.choose

    def traced(self, bucket, remaining=None, in_rounds=True):
        k = choose(self, bucket, remaining, in_rounds)
        choices.append([bucket, k, remaining is not None])
        return k

    SpeculationPolicy.choose = traced
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line]
    prompts = (prompts * (args.requests // len(prompts) + 1))[: args.requests]
    llm = LLM(device=args.device, max_num_seqs=args.max_num_seqs)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    total = time.perf_counter() - start
    backlogs = [b for b, _ in calls]
    millis = [s * 1e3 for _, s in calls]
    result = {
        "argv": vars(args),
        "seconds": total,
        "k_chosen": llm.engine.loop_stats.k_chosen,
        "proposes": len(calls),
        "backlog_median": statistics.median(backlogs) if calls else None,
        "backlog_max": max(backlogs, default=None),
        "propose_ms_median": statistics.median(millis) if calls else None,
        "propose_ms_max": max(millis, default=None),
        "calls": [[b, round(m, 3)] for b, m in zip(backlogs, millis, strict=True)],
        "policy_costs_ms": {
            f"{bucket},{k}": [round(seconds * 1e3, 2), n]
            for (bucket, k), (seconds, n) in llm.engine.policy.costs().items()
        },
        "catch_ups_ms": [[b, k, round(s * 1e3, 2)] for b, k, s in llm.engine.policy._catch_ups],
        "acceptance": [llm.engine.policy.acceptance(i) for i in range(llm.engine.policy.max_k)],
        "choices": choices,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("calls", "choices")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
