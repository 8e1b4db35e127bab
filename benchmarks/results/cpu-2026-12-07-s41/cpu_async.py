"""s41, CPU: plain and speculative engines, synchronous step or the overlapped loop (device rounds
op by op), with and without the plain arm, in one process, two runs alternating.
`python cpu_async.py BATCH` (from the repository root)."""

import json
import sys
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench_serve.client import read_prompts

torch.set_num_threads(2)
batch = int(sys.argv[1])
prompts = (read_prompts("benchmarks/data/heldout_prompts.jsonl") * 4)[: max(16, 2 * batch)]
arm = {"method": "eagle", "num_speculative_tokens": 1, "plain_arm": True}
engines = {
    "plain_sync": LLM(
        device="cpu", max_num_seqs=batch, speculative_config=None, async_scheduling=False
    ),
    "plain_async": LLM(
        device="cpu", max_num_seqs=batch, speculative_config=None, async_scheduling=True
    ),
    "spec_sync": LLM(device="cpu", max_num_seqs=batch, async_scheduling=False),
    "spec_async": LLM(device="cpu", max_num_seqs=batch, async_scheduling=True),
    "spec_async_arm": LLM(
        device="cpu", max_num_seqs=batch, async_scheduling=True, speculative_config=arm
    ),
}
print({k: (v.engine.async_scheduling, v.engine.device_rounds) for k, v in engines.items()})
chats = [[{"role": "user", "content": p}] for p in prompts]
params = [
    SamplingParams(max_tokens=32, temperature=0.8, seed=i, ignore_eos=True)
    for i in range(len(chats))
]
outs = {}
for run in range(2):
    for name, llm in engines.items():
        t = time.perf_counter()
        out = llm.chat(chats, params, use_tqdm=False)
        d = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in out)
        outs.setdefault(name, [o.outputs[0].token_ids for o in out])
        ls = llm.engine.loop_stats
        counts = (ls.num_device_rounds, ls.num_sync_steps, ls.num_plain_arm_steps)
        print(run, name, round(n / d, 1), "tok/s", json.dumps(ls.k_chosen), *counts, flush=True)
print("same tokens:", {k: v == outs["plain_sync"] for k, v in outs.items()})
