"""Structured outputs: the cost of a grammar constraint, with and without speculation.

For each batch size: TPOT of unconstrained vs constrained decoding (every request under a
permissive JSON schema), plain and speculative, and a mixed batch (half the requests
constrained); and the host time the grammar masks take per emitted token per request (every
`GrammarMatcher` mask computation timed, prefetched ones included).

- `--shape smollm2` (default): the built-in SmolLM2-135M-Instruct GGUF, speculation by its
  shipped EAGLE head; chat prompts asking for JSON. Runs on the CPU or CUDA.
- `--shape llama-3.2-1b`: random bf16 weights of that shape on CUDA with SmolLM2's tokenizer
  (the grammar needs one), speculation by a truncated draft model (the target's first 2 layers).

The schema is an array of at least 1000 arbitrary JSON objects: it never closes within the
output length, so every request emits `--output-len` tokens under the constraint (EOS is
ignored by the unconstrained runs too). Greedy decoding (temperature 0); TPOT is the decode
phase's wall time per output token, (t(1 + n) - t(1)) / n, each t the median of `--repeats`
generate calls after a warm-up.

    PYTHONPATH=src:tests python benchmarks/bench_structured.py --out FILE.json
        [--shape smollm2|llama-3.2-1b] [--device cpu|cuda] [--batches 1,32] [--output-len 128]

`--output-len 4 --batches 1 --repeats 1` is a seconds-long smoke test (not a figure). Never
imported by tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SCHEMA = {"type": "array", "items": {"type": "object"}, "minItems": 1000}
PROMPT = "List some objects as a JSON array of JSON objects."


def log(*args) -> None:
    print(*args, flush=True)


class MaskTimer:
    """Wraps `GrammarMatcher._mask` (where every mask is computed) to sum its seconds."""

    def __init__(self) -> None:
        from specdec.sampling.grammar import GrammarMatcher

        self.seconds = 0.0
        self.count = 0
        self._cls = GrammarMatcher
        self._real = GrammarMatcher._mask
        timer = self

        def timed(matcher, prefix):
            cached = prefix in matcher._masks
            start = time.perf_counter()
            out = timer._real(matcher, prefix)
            if not cached:
                timer.seconds += time.perf_counter() - start
                timer.count += 1
            return out

        GrammarMatcher._mask = timed

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0

    def close(self) -> None:
        self._cls._mask = self._real


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def load(shape: str, device: str):
    """(model, tokenizer, speculative config)."""
    from specdec.models import default_model_path, load_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    smollm2 = load_model(str(default_model_path()), dtype=dtype, device=device)
    if shape == "smollm2":
        from specdec.drafters.default import default_speculative_config

        return smollm2.model, smollm2.tokenizer, default_speculative_config(None, device)
    from bench_gpu_engine import build_ours

    spec = {"method": "draft_model", "model": "truncated:2", "num_speculative_tokens": 3}
    return build_ours(shape), smollm2.tokenizer, spec


def make_llm(model, tokenizer, spec, device: str, batch: int, max_model_len: int):
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm import LLM
    from specdec.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=batch,
        max_model_len=max_model_len,
        num_kv_blocks=batch * (-(-max_model_len // 16) + 2) + 64,
    )
    llm = LLM.__new__(LLM)
    spec_config = None if spec is None else SpeculativeConfig.from_dict(spec)
    llm.engine = LLMEngine(config, spec_config, model=model, tokenizer=tokenizer)
    return llm


def tpot(llm, prompts, constrained: list[bool], output_len: int, repeats: int, device, timer):
    """Decode TPOT (s), mask seconds per constrained emitted token, and loop figures."""
    from specdec.sampling import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=SCHEMA)

    def run(max_tokens: int) -> tuple[float, int]:
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                structured_outputs=constraint if c else None,
            )
            for c in constrained
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        times, tokens = [], 0
        for _ in range(repeats):
            timer.reset()
            sync(device)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            times.append(time.perf_counter() - start)
            tokens = sum(
                len(o.outputs[0].token_ids) for o, c in zip(outputs, constrained, strict=True) if c
            )
        return statistics.median(times), tokens

    first, _ = run(1)
    whole, constrained_tokens = run(1 + output_len)
    mask_s = timer.seconds  # of the last repeat of the long run
    metrics = llm.get_metrics()
    return {
        "tpot_s": (whole - first) / output_len,
        "mask_s_per_token_per_request": mask_s / constrained_tokens if constrained_tokens else None,
        "masks_computed": timer.count,
        "mean_acceptance_length": metrics.get("mean_acceptance_length"),
        "loop": metrics.get("loop"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="smollm2", choices=["smollm2", "llama-3.2-1b"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.shape != "smollm2" and device != "cuda":
        parser.error(f"--shape {args.shape} needs --device cuda")
    model, tokenizer, spec = load(args.shape, device)
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    max_model_len = len(prompt) + args.output_len + 32
    timer = MaskTimer()
    results = {
        "shape": args.shape,
        "device": device,
        "output_len": args.output_len,
        "speculative_config": spec,
        "schema": SCHEMA,
        "rows": [],
    }
    try:
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = [prompt] * batch
            for spec_name, config in (("plain", None), ("speculative", spec)):
                llm = make_llm(model, tokenizer, config, device, batch, max_model_len)
                modes = {
                    "unconstrained": [False] * batch,
                    "constrained": [True] * batch,
                    "mixed": [i % 2 == 0 for i in range(batch)],
                }
                for mode, constrained in modes.items():
                    if mode == "mixed" and batch == 1:
                        continue
                    row = tpot(
                        llm, prompts, constrained, args.output_len, args.repeats, device, timer
                    )
                    row |= {"batch": batch, "decoding": spec_name, "mode": mode}
                    results["rows"].append(row)
                    log(
                        f"batch {batch:>3} {spec_name:>11} {mode:>13}: TPOT "
                        f"{row['tpot_s'] * 1e3:.2f} ms, mask "
                        f"{(row['mask_s_per_token_per_request'] or 0) * 1e6:.1f} us/token/request"
                    )
                del llm
    finally:
        timer.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2), encoding="utf-8")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
