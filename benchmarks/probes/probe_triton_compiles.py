"""Do Triton kernels compile again inside timed generate calls? (the plain arm's stalls)

With the policy's plain arm on, a few SmolLM2 generate calls take 2.5x as long as the others
(one 449 ms step; benchmarks/results/h200-2026-12-01-s9 and -s10) while no CUDA graph is
captured. A Triton kernel compiles a new variant (~0.3-0.5 s) whenever an integer argument
changes between 1, a multiple of 16 and anything else, or a pointer's 16-byte alignment
changes, and the eager paths (the head's catch-up after plain steps, whose entry counts and
block-table widths vary per visit) pass such arguments. This probe runs the same generate call
several times per configuration and records, after each, its seconds and the variants every
specdec Triton kernel gained.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_triton_compiles.py --out DIR \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf

Writes DIR/triton_compiles.json. A profile, not a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_spec_round import load_smollm2, make_engine, smollm2_batch  # noqa: E402


def kernel_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel defined in a specdec module."""
    from triton.runtime.jit import JITFunction

    counts = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("specdec") or module is None:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction):
                caches = getattr(value, "device_caches", {})
                total = 0
                for entry in caches.values():
                    cache = entry[0] if isinstance(entry, tuple) else entry
                    total += len(cache)
                counts[f"{name}.{attr}"] = total
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    model, tokenizer, encoded, head = load_smollm2(args.gguf, "cuda")
    adaptive = {**head, "num_speculative_tokens": 4, "adaptive": True}
    results = {}
    for batch, temperature, plain_arm in ((8, 1.0, True), (32, 0.0, True), (32, 0.0, False)):
        prompts, blocks, params = smollm2_batch(encoded, batch, args.output_len, temperature)
        spec = {**adaptive, "plain_arm": plain_arm}
        llm = make_engine(
            model, tokenizer, spec, device="cuda", max_num_seqs=batch, max_model_len=1024,
            blocks=blocks,
        )  # fmt: skip
        calls = []
        before = kernel_variants()
        for _ in range(args.calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            after = kernel_variants()
            grown = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
            calls.append({"ms": round(seconds * 1e3, 2), "new_variants": grown})
            before = after
        name = f"b{batch} T={temperature:g} {'plain-arm' if plain_arm else 'rounds'}"
        results[name] = calls
        print(f"[compiles] {name}: {json.dumps(calls)}", flush=True)
        del llm
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_compiles.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'triton_compiles.json'}")


if __name__ == "__main__":
    main()
