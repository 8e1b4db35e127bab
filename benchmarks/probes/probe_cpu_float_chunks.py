"""What the CPU's row-invariant float product costs: the built-in model dequantized to float32
(`LLM(quantization=None)`, plain decoding), a 512-token prefill, batch-1 decode (48 tokens) and
batch 8 (32 tokens each), with the products in chunks of 4, 8 and 16 rows (`CPU_ROW_CHUNK`) and
with the rule before s27 (rows padded to a multiple of 4, one product: not batch-invariant on
every BLAS), interleaved.

`PYTHONPATH=src python3 benchmarks/probes/probe_cpu_float_chunks.py [--rounds 3] [--threads 2]`
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specdec import LLM, SamplingParams
from specdec.models import linear as linear_module


def padded_to_four(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The product before s27: rows padded with zeros to a multiple of 4, one F.linear."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    extra = -count % 4
    if extra:
        rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
    out = F.linear(rows, weight, bias)[:count]
    return out.reshape(*lead, out.shape[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunked = linear_module._chunked_linear
    llm = LLM(quantization=None, speculative_config=None, max_num_seqs=8)
    long_prompt = {"prompt_token_ids": list(range(1000, 1512))}
    greedy = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)
    batch = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
    for _ in range(args.rounds):
        for variant in ("padded to 4", 4, 8, 16):
            if variant == "padded to 4":
                linear_module._chunked_linear = padded_to_four
            else:
                linear_module._chunked_linear = chunked
                linear_module.CPU_ROW_CHUNK = variant
                linear_module._CPU_CHUNK_OK.clear()
            started = time.perf_counter()
            llm.generate([long_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            llm.generate(["Say hi."], greedy, use_tqdm=False)
            decode = (time.perf_counter() - started) / 48
            started = time.perf_counter()
            llm.generate(["Say hi."] * 8, batch, use_tqdm=False)
            rate = 8 * 32 / (time.perf_counter() - started)
            print(
                f"{variant!s:>12}: prefill 512 {prefill:.3f} s | batch 1 {decode * 1e3:.2f} ms a "
                f"token | batch 8 {rate:.1f} tokens/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
