"""s35: the default speculation's synchronous steps by kind (decode rows, drafted or not, with a
prefill chunk or not), timed one by one, for 64 held-out chats through 8 slots in process (as
`k0.py default`). Run from the repository root: `python steps.py`."""

import collections
import json
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    lines = Path("benchmarks/data/heldout_prompts.jsonl").read_text().splitlines()
    prompts = ([json.loads(line)["prompt"] for line in lines if line] * 10)[:64]
    llm = LLM(device="cpu", max_num_seqs=8)
    engine = llm.engine
    steps = []
    run_step = type(engine)._run_step

    def timed(self, scheduled, only_finished):
        decodes = [s for s in scheduled if not s.request.in_prefill]
        drafts = sum(s.num_query_tokens - 1 for s in decodes)
        prefill = sum(s.num_query_tokens for s in scheduled if s.request.in_prefill)
        start = time.perf_counter()
        out = run_step(self, scheduled, only_finished)
        steps.append((len(decodes), drafts > 0, prefill > 0, time.perf_counter() - start))
        return out

    type(engine)._run_step = timed
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, ignore_eos=True) for i in range(64)
    ]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:8], params[:8], use_tqdm=False)
    steps.clear()
    start = time.perf_counter()
    llm.chat(chats, params, use_tqdm=False)
    print("total s", round(time.perf_counter() - start, 2), "steps", len(steps))
    groups = collections.defaultdict(list)
    for decodes, drafted, prefill, seconds in steps:
        groups[(decodes, drafted, prefill)].append(seconds)
    print("(decode rows, drafted, prefill chunk): steps, median ms, sum s")
    for key in sorted(groups):
        times = groups[key]
        print(key, len(times), round(statistics.median(times) * 1e3, 1), round(sum(times), 2))


if __name__ == "__main__":
    main()
