"""The eager prefill against the graphed prefill's chunks on the decode path, on the CPU: whether
`prefill_graph_tokens` should be on there. The built-in SmolLM2 (the GGUF kept quantized, whose
decode path runs op by op on the CPU), held-out prompts, one output token, batches 1 and 8, the
median of 5 calls each with `prefill_graph_tokens` 0 (eager) and 128 (16-token chunks).

    PYTHONPATH=src python benchmarks/probes/probe_prefill_paths.py --out FILE [--threads 2]

Writes FILE (JSON). A profile, not a BENCHMARKS.md figure by itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams

    lines = (HERE.parent / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()][:8]
    report: dict = {"threads": args.threads, "calls": args.calls, "ms": {}}
    for tokens in (0, 128):
        llm = LLM(prefill_graph_tokens=tokens, max_num_seqs=8)
        tokenizer = llm.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.encode_chat([{"role": "user", "content": text}])}
            for text in texts
        ]
        report["prompt_lengths"] = [len(p["prompt_token_ids"]) for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=1)
        for batch in (1, 8):
            llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                llm.generate(prompts[:batch], params, use_tqdm=False)
                times.append((time.perf_counter() - start) * 1e3)
            report["ms"][f"prefill_graph_tokens={tokens} batch={batch}"] = round(
                statistics.median(times), 1
            )
        print(json.dumps(report["ms"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
