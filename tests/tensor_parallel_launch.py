"""A script every rank of an env-var launch (torchrun's RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT) runs unchanged: `python tensor_parallel_launch.py MODEL PROMPT_IDS_JSON`. Rank 0
prints its greedy tokens as JSON; the other ranks become workers inside `LLM(...)`."""

from __future__ import annotations

import json
import sys

import torch

from specdec import LLM, SamplingParams

if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM(
        sys.argv[1],
        tensor_parallel_size=2,
        speculative_config=None,
        quantization=None,
        max_num_seqs=4,
        num_kv_blocks=64,
    )
    prompts = json.loads(sys.argv[2])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    print(json.dumps([out.outputs[0].token_ids for out in outputs]))
    llm.close()
