"""s35: plain requests on a speculating engine against an engine without speculation, in process
(held-out chats, T = 0.8, 64 tokens, 2 threads; 16 chats through 1 slot or 64 through 8, after a
warm-up of one batch): `nospec` (no drafter), `plainreq` (the default speculation, every request
with `speculative={"enabled": False}`). Run from the repository root: `python plain_requests.py
nospec|plainreq SLOTS`; the code before 4e7150a was run with PYTHONPATH pointing at its src."""

import json
import sys
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    mode, slots = sys.argv[1], int(sys.argv[2])
    count = 64 if slots > 1 else 16
    lines = Path("benchmarks/data/heldout_prompts.jsonl").read_text().splitlines()
    prompts = ([json.loads(line)["prompt"] for line in lines if line] * 10)[:count]
    engine_args = {"speculative_config": None} if mode == "nospec" else {}
    llm = LLM(device="cpu", max_num_seqs=slots, **engine_args)
    request_args = {"speculative": {"enabled": False}} if mode == "plainreq" else {}
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, ignore_eos=True)
        for i in range(count)
    ]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:slots], params[:slots], use_tqdm=False, **request_args)
    start = time.perf_counter()
    llm.chat(chats, params, use_tqdm=False, **request_args)
    print(mode, slots, round(time.perf_counter() - start, 3), flush=True)


if __name__ == "__main__":
    main()
