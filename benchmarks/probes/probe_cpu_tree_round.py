"""Where a speculative step's time goes on the CPU, chain or tree: a diagnostic, not a benchmark.

    python benchmarks/probes/probe_cpu_tree_round.py [--tree 16x6x2 | --k 1] [--temperature 0]
        [--tokens 64] [--threads 2] [--device cuda --model GGUF] > FILE.txt

Runs the built-in SmolLM2 with the shipped EAGLE head (synchronous engine path), one warm-up
chat on a held-out prompt, then one more under cProfile, and prints the seconds, the mean
acceptance length and the functions by cumulative time (the target's forward, the int4 kernel,
the tree drafting, the verifier). `--device cuda` profiles the host side of the same synchronous
path on a GPU (there the host's time is the round's: CUDA calls return at once).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "heldout_prompts.jsonl"
HEAD = "src/specdec/drafters/default/smollm2-135m-instruct-eagle"


def main() -> None:
    from specdec import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=None, help="NODESxDEPTHxTOPK (default: a chain)")
    parser.add_argument("--k", type=int, default=1, help="chain drafts a round")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default: built-in)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "eagle", "model": HEAD, "adaptive": False}  # every step drafts
    if args.tree:
        nodes, depth, topk = map(int, args.tree.split("x"))
        spec["tree"] = {"nodes": nodes, "depth": depth, "topk": topk}
    else:
        spec["num_speculative_tokens"] = args.k
    llm = LLM(
        args.model,
        speculative_config=spec,
        max_num_seqs=1,
        device=args.device,
        async_scheduling=False,
    )
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines[:2]]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, seed=1
    )
    llm.chat([[{"role": "user", "content": prompts[0]}]], params, use_tqdm=False)  # warm-up
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.chat([[{"role": "user", "content": prompts[1]}]], params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - start
    acceptance = llm.get_metrics().get("mean_acceptance_length")
    print(f"seconds {seconds:.3f} acceptance {acceptance}")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
    if args.device == "cuda":
        print_triton_variants()


def print_triton_variants() -> None:
    """Each Triton kernel compiled in this process and its variants (one per specialisation key:
    constexpr values, integer arguments equal to 1 or divisible by 16, dtypes)."""
    import gc

    from triton.runtime.jit import JITFunction

    for fn in gc.get_objects():
        if not isinstance(fn, JITFunction):
            continue
        variants = [key for cache in fn.device_caches.values() for key in cache[0]]
        if variants:
            print(f"triton {fn.__name__}: {len(variants)} variant(s)")
            for key in variants:
                print(f"    {str(key)[:400]}")


if __name__ == "__main__":
    main()
