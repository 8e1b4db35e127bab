"""Passkey retrieval on the built-in SmolLM2 (8,192-token context) on the CPU: the model's
accuracy at each prompt length and needle depth, greedy and sampled, with speculation (the
shipped EAGLE head, and n-gram) on and off, and whether speculative output equals plain output.

    PYTHONPATH=src:tests python benchmarks/bench_long_context_cpu.py --out DIR \
        [--lengths 2048,4096,8000] [--depths 0.1,0.5,0.9] [--trials 3] [--new-tokens 16]

Writes DIR/long_context_cpu.json: per (length, depth, trial) the prompt length, the passkey, each
variant's answer text, whether it contains the passkey, whether it loops (a repeated n-gram),
and per length the accuracy of each variant. Greedy speculative == greedy plain and coupled ==
plain sampling are exactness checks (a mismatch is reported, not hidden); accuracy is the
model's. Filler text: `tests/long_context_fixtures.py`. Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from long_context_fixtures import passkey_prompt, repeated_ngram_loop
from specdec import LLM, SamplingParams

SAMPLED_SEED = 1234
PLAIN = {"enabled": False}
# variant name -> (engine, sampling kind, per-request speculative override)
VARIANTS = {
    "greedy plain": ("eagle", "greedy", PLAIN),
    "greedy eagle": ("eagle", "greedy", None),
    "greedy ngram": ("ngram", "greedy", None),
    "sampled plain": ("eagle", "sampled", PLAIN),
    "sampled eagle coupled": ("eagle", "sampled", {"rejection_sample_method": "coupled"}),
    "sampled eagle standard": ("eagle", "sampled", None),
}
# Pairs that must agree token for token.
EXACT_PAIRS = [
    ("greedy eagle", "greedy plain"),
    ("greedy ngram", "greedy plain"),
    ("sampled eagle coupled", "sampled plain"),
]


def log(*args) -> None:
    print(*args, flush=True)


def passkey_for(length: int, depth: float, trial: int) -> str:
    """A fixed 5-digit passkey per case (no repeated digit, so a loop cannot spell it)."""
    value = 10000 + (trial * 7919 + length * 31 + int(depth * 1000) * 17) % 90000
    while len(set(str(value))) < 5:
        value = 10000 + (value * 7 + 3) % 90000
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="2048,4096,8000")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    start = time.perf_counter()
    engines = {
        "eagle": LLM(),  # the shipped EAGLE head (K = 2)
        "ngram": LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    }
    tokenizer = engines["eagle"].get_tokenizer()
    params = {
        "greedy": SamplingParams(temperature=0, max_tokens=args.new_tokens),
        "sampled": SamplingParams(
            temperature=0.7, top_p=0.95, max_tokens=args.new_tokens, seed=SAMPLED_SEED
        ),
    }
    cases, mismatches = [], []
    for length in lengths:
        for depth in depths:
            for trial in range(args.trials):
                passkey = passkey_for(length, depth, trial)
                prompt = passkey_prompt(tokenizer, length, passkey, depth)
                case = {
                    "length": length,
                    "prompt_tokens": len(prompt),
                    "depth": depth,
                    "trial": trial,
                    "passkey": passkey,
                    "answers": {},
                }
                tokens = {}
                for name, (engine, kind, override) in VARIANTS.items():
                    llm = engines[engine]
                    result = llm.generate(
                        [prompt], params[kind], speculative=override, use_tqdm=False
                    )[0].outputs[0]
                    tokens[name] = list(result.token_ids)
                    case["answers"][name] = {
                        "text": result.text,
                        "correct": passkey in result.text,
                        "loops": repeated_ngram_loop(result.token_ids),
                    }
                case["exact"] = {f"{a} == {b}": tokens[a] == tokens[b] for a, b in EXACT_PAIRS}
                mismatches += [(length, depth, trial, k) for k, v in case["exact"].items() if not v]
                cases.append(case)
                log(f"[passkey] {length} d={depth} t={trial}: {case['answers']['greedy plain']}")
    accuracy = {}
    for length in lengths:
        rows = [c for c in cases if c["length"] == length]
        accuracy[str(length)] = {
            name: sum(c["answers"][name]["correct"] for c in rows) / len(rows) for name in VARIANTS
        }
        accuracy[str(length)]["loops"] = sum(
            a["loops"] for c in rows for a in c["answers"].values()
        )
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - start,
        },
        "accuracy": accuracy,
        "exact_mismatches": mismatches,
        "cases": cases,
    }
    path = out / "long_context_cpu.json"
    path.write_text(json.dumps(result, indent=2))
    log(f"accuracy: {json.dumps(accuracy)}; exact mismatches: {mismatches}; wrote {path}")


if __name__ == "__main__":
    main()
