"""What the CPU's Philox rounds cost: torch operations against NumPy uint64, alone and in decoding.

1. One `philox4x32_10` call over the blocks of a full-vocabulary draw (49,152 float32 lanes:
   12,288 blocks) and of two and eight rows of them, each way: torch operations, the NumPy rounds
   of `random_words`' layout (per-row scalar keys), the general NumPy rounds (median ms of 30
   calls; the words must be equal).
2. The built-in model (the CPU default: the kept-quantized GGUF), plain decoding and the default
   speculation, T = 1, 48 tokens of one held-out prompt: tokens/s with `random_words` drawing
   through each of the three, alternating, the median of `--repeats` calls each (the tokens
   must be equal).

    PYTHONPATH=src python benchmarks/probes/probe_cpu_philox.py --out FILE [--threads 2]

Pin the threads and run it on an otherwise idle machine. Writes FILE (JSON); never imported by
tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def time_call(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_part() -> dict:
    from specdec.rng import philox

    out = {}
    generator = torch.Generator().manual_seed(0)
    c0 = torch.arange(12288, dtype=torch.int64)[None, :]
    for rows in (1, 2, 8):
        words = torch.randint(0, 2**32, (5, rows, 1), generator=generator, dtype=torch.int64)
        want = philox.philox4x32_10_torch(c0, *words)
        got = philox._philox_cpu(c0, *words)
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise AssertionError("the NumPy rounds differ from the torch ones")
        general = philox._philox_cpu_any(c0, *words)
        if not all(torch.equal(a, b) for a, b in zip(general, want, strict=True)):
            raise AssertionError("the general NumPy rounds differ from the torch ones")
        out[f"rows={rows}"] = {
            "torch_ms": time_call(lambda w=words: philox.philox4x32_10_torch(c0, *w), 30),
            "numpy_ms": time_call(lambda w=words: philox._philox_cpu(c0, *w), 30),
            "numpy_general_ms": time_call(lambda w=words: philox._philox_cpu_any(c0, *w), 30),
        }
    return out


def decode_part(repeats: int) -> dict:
    from specdec import LLM, SamplingParams
    from specdec.rng import draws, philox

    prompt = json.loads((HERE.parent / "data" / "heldout_prompts.jsonl").read_text().split("\n")[0])
    text = prompt["prompt"] if "prompt" in prompt else prompt["messages"][-1]["content"]
    out = {}
    for name, kwargs in (("plain", {"speculative_config": None}), ("default speculation", {})):
        llm = LLM(**kwargs)
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": text}])
        params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=1)
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)  # warm-up
        rates: dict[str, list[float]] = {"torch": [], "numpy": [], "numpy_general": []}
        tokens = {}
        ways = (
            ("numpy", philox.philox4x32_10),
            ("numpy_general", philox._philox_cpu_any),
            ("torch", philox.philox4x32_10_torch),
        )
        for _ in range(repeats):
            for way, fn in ways:
                draws.philox4x32_10 = fn
                start = time.perf_counter()
                result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                rates[way].append(48 / (time.perf_counter() - start))
                tokens[way] = result[0].outputs[0].token_ids
        draws.philox4x32_10 = philox.philox4x32_10
        out[name] = {
            "tokens_per_s": {way: statistics.median(r) for way, r in rates.items()},
            "runs": rates,
            "same_tokens": tokens["numpy"] == tokens["torch"] == tokens["numpy_general"],
        }
        out[name]["speedup"] = (
            out[name]["tokens_per_s"]["numpy"] / out[name]["tokens_per_s"]["torch"]
        )
        llm.engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "philox_call": kernel_part()}
    print(json.dumps(result["philox_call"], indent=1), flush=True)
    result["decode_T1"] = decode_part(args.repeats)
    print(json.dumps(result["decode_T1"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
