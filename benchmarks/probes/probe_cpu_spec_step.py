"""What a speculative step costs on the CPU, part by part, against a plain step.

The built-in SmolLM2 (the GGUF kept quantized, the CPU default) with the shipped EAGLE head at
K = 1 and K = 2, held at K = 0 by the policy (`--held-k0`: a speculating engine's plain steps),
and without speculation; greedy (or `--temperature`), 48 tokens per prompt,
`--batch` held-out prompts at once. Per part of the synchronous step (the drafter's `propose`,
the target's forward over [input token + drafts], `emit`: sampling and verification, feature
delivery) the median host milliseconds per call; tokens/s of the whole call. Pin the threads
and run it on an otherwise idle machine.

    PYTHONPATH=src python benchmarks/probes/probe_cpu_spec_step.py --out FILE [--batch 1] \
        [--threads 2] [--temperature 1] [--pinned] [--held-k0]

Writes FILE (JSON). A profile, not a BENCHMARKS.md figure by itself.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def run(
    spec: dict | None, texts: list[str], tokens: int, temperature: float = 0.0, k0: bool = False
) -> dict:
    from specdec import LLM, SamplingParams
    from specdec.engine import llm_engine

    llm = LLM(speculative_config=spec)
    if k0:  # the policy holds K = 0: every step the speculating engine's plain step
        type(llm.engine.policy)._choose = lambda *args: 0
    prompts = [
        {"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": text}])}
        for text in texts
    ]
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    engine = llm.engine
    host: dict[str, list[float]] = collections.defaultdict(list)
    parts = [
        (llm_engine, "propose", "propose"),
        *([(engine.drafter, "propose", "drafter.propose")] if engine.drafter is not None else []),
        (llm_engine, "deliver_features", "deliver_features"),
        (engine.emitter, "emit", "emit"),
        (engine.runner, "run_with_features", "target forward"),
    ]
    for obj, name, label in parts:
        inner = getattr(obj, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                host[_label].append((time.perf_counter() - start) * 1e3)

        setattr(obj, name, timed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for obj, name, _ in parts:  # module functions back; instance attributes removed
        if obj is llm_engine:
            setattr(obj, name, _ORIGINALS[name])
        else:
            delattr(obj, name)
    emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tokens_per_s": round(emitted / seconds, 2),
        "mean_acceptance_length": llm.get_metrics().get("mean_acceptance_length"),
        "median_ms": {k: round(statistics.median(v), 3) for k, v in host.items()},
        "calls": {k: len(v) for k, v in host.items()},
    }


_ORIGINALS: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--pinned", action="store_true", help="K pinned (no adaptive policy)")
    parser.add_argument("--held-k0", action="store_true", help="also the policy held at K = 0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.drafters.default import DEFAULT_EAGLE_DIR
    from specdec.engine import llm_engine

    _ORIGINALS.update({name: getattr(llm_engine, name) for name in ("propose", "deliver_features")})
    lines = (HERE.parent / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.batch]
    head = {"method": "eagle", "model": str(DEFAULT_EAGLE_DIR)}
    report = {
        "batch": args.batch,
        "threads": args.threads,
        "tokens": args.tokens,
        "temperature": args.temperature,
    }
    pinned = {"adaptive": False} if args.pinned else {}
    arms = [
        ("plain", None, False),
        ("eagle K=1", {**head, "num_speculative_tokens": 1, **pinned}, False),
        ("eagle K=2", {**head, "num_speculative_tokens": 2, **pinned}, False),
    ]
    if args.held_k0:
        arms.insert(1, ("eagle held at K=0", {**head, "num_speculative_tokens": 1}, True))
    from specdec.engine.spec_policy import SpeculationPolicy

    choose = SpeculationPolicy._choose
    for name, spec, k0 in arms:
        report[name] = run(spec, texts, args.tokens, args.temperature, k0)
        SpeculationPolicy._choose = choose
        print(name, json.dumps(report[name]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
