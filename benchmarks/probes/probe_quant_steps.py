"""Kept-quantized weights on CUDA through the engine: prefill, decode and continuous batching,
with whatever `specdec` is on the path (run it with two source trees one after the other in one
lease to compare them: s34 moved prompt rows to the dequantized GEMM and every other row to
the weight-only kernel, whatever shares the step).

For each format: the prefill of one long prompt and of a burst of short ones (max_tokens 1,
median of three), TPOT at batch 1 and 64 (`engine_tpot`), and 128 requests through 16 slots
(prompts joining decode rows), each as wall seconds.

`PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_quant_steps.py --out FILE.json
[--shape llama-3.2-1b] [--formats int4,fp8]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

from bench_gpu_engine import build_ours, engine_tpot, make_llm, random_prompts


def wall_s(llm, prompts, max_tokens: int, repeats: int = 3) -> float:
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--formats", default="int4,fp8")
    args = parser.parse_args()
    import specdec

    result = {"specdec": specdec.__file__, "shape": args.shape, "formats": {}}
    for fmt in args.formats.split(","):
        try:
            result["formats"][fmt] = measure(args.shape, fmt)
        except Exception as error:  # a format that fails is reported, the others still run
            traceback.print_exc()
            result["formats"][fmt] = {"error": f"{type(error).__name__}: {error}"}
        print(specdec.__file__, fmt, result["formats"][fmt], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def measure(shape: str, fmt: str) -> dict:
    """The figures of one format (see the module docstring), in seconds / milliseconds."""
    from specdec.models import quantize_model

    model = build_ours(shape)
    quantize_model(model, fmt)
    torch.cuda.empty_cache()
    vocab = model.config.vocab_size
    row: dict = {}
    llm = make_llm(model, None, max_num_seqs=64, max_model_len=2048)
    long_prompt = random_prompts(1, vocab, seed=1, length=1800)
    short_burst = random_prompts(16, vocab, seed=2, length=48)
    wall_s(llm, long_prompt, 1, repeats=1)  # warm-up
    wall_s(llm, short_burst, 1, repeats=1)
    row["prefill_1800_s"] = wall_s(llm, long_prompt, 1)
    row["prefill_16x48_s"] = wall_s(llm, short_burst, 1)
    for batch in (1, 64):
        prompts = random_prompts(batch, vocab, seed=batch)
        row[f"tpot_b{batch}_ms"] = engine_tpot(llm, prompts, 64)["tpot_ms"]
    del llm
    llm = make_llm(model, None, max_num_seqs=16, max_model_len=2048)
    joining = random_prompts(128, vocab, seed=3, length=200)
    wall_s(llm, joining[:16], 64, repeats=1)
    row["joining_128x200_through_16_s"] = wall_s(llm, joining, 64, repeats=2)
    del llm, model
    torch.cuda.empty_cache()
    return {k: round(v, 5) for k, v in row.items()}


if __name__ == "__main__":
    main()
