"""s35: 64 held-out chats through 8 slots in process (LLM.chat, T = 0.8, 64 tokens, 2 threads),
after 8 of them as a warm-up: `plain` (no speculation), `k0` (the default speculation with the
policy pinned to K = 0: what feeding the drafter costs) or `default`. Run from the repository
root: `python k0.py plain|k0|default`."""

import json
import sys
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.engine.spec_policy import SpeculationPolicy


def main() -> None:
    torch.set_num_threads(2)
    mode = sys.argv[1]
    if mode == "k0":
        SpeculationPolicy.choose = lambda self, bucket, remaining=None, in_rounds=True: 0
    lines = Path("benchmarks/data/heldout_prompts.jsonl").read_text().splitlines()
    prompts = ([json.loads(line)["prompt"] for line in lines if line] * 10)[:64]
    kw = {"speculative_config": None} if mode == "plain" else {}
    llm = LLM(device="cpu", max_num_seqs=8, **kw)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, ignore_eos=True) for i in range(64)
    ]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:8], params[:8], use_tqdm=False)
    start = time.perf_counter()
    llm.chat(chats, params, use_tqdm=False)
    seconds = round(time.perf_counter() - start, 3)
    print(mode, seconds, llm.engine.loop_stats.k_chosen, flush=True)


if __name__ == "__main__":
    main()
