"""What plain decoding with penalties costs when its logits rules are rebuilt every step
(`LogitsContext`) against kept on the device (`engine/request_rules.py`, s42), and without rules,
in one process: `LLM.generate` on the same prompts, alternating the three, each run a fresh
engine of the same model.

    PYTHONPATH=src python benchmarks/probes/probe_rule_rows.py [--model GGUF_OR_DIR] \
        [--device cpu] [--batch 16] [--max-tokens 64] [--runs 3] [--out FILE]

The model defaults to the built-in SmolLM2 GGUF. Prints tokens/s per variant (median of the
runs) and the ratios; writes FILE (JSON) when given. On the CPU run it on an otherwise idle
machine (threads pinned: `--threads`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "src"))

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1}


def run_once(args, variant: str, prompts: list[str]) -> float:
    from specdec import LLM, SamplingParams

    llm = LLM(args.model, speculative_config=None, device=args.device, max_num_seqs=args.batch)
    if variant == "rebuilt":
        llm.engine.emitter._rule_rows = 0  # every step builds a LogitsContext
    rules = {} if variant == "no rules" else PENALTIES
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True, **rules
        )
        for i in range(len(prompts))
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # first-step costs out of the timing
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if variant == "kept":
        assert llm.engine.emitter.request_rules is not None
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in GGUF")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from specdec.models.registry import default_model_path

        args.model = str(default_model_path())
    prompts = [f"Write a short note about topic number {i}." for i in range(args.batch)]
    variants = ["rebuilt", "kept", "no rules"]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.runs):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            rate = run_once(args, variant, prompts)
            rates[variant].append(rate)
            print(f"run {r} {variant}: {rate:.1f} tokens/s", flush=True)
    medians = {v: statistics.median(x) for v, x in rates.items()}
    print({v: round(m, 1) for v, m in medians.items()})
    print(
        f"kept / rebuilt {medians['kept'] / medians['rebuilt']:.3f}x; "
        f"kept / no rules {medians['kept'] / medians['no rules']:.3f}x"
    )
    if args.out:
        record = {
            "date": date.today().isoformat(),
            "machine": platform.processor() or platform.machine(),
            "argv": sys.argv,
            "tokens_per_s": rates,
            "medians": medians,
        }
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
