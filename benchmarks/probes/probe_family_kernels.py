"""Where a family's decode step spends its device time (issue 37: Qwen3-8B and Gemma-2-9B ran
1.18x and 1.56x Llama-3-8B's TPOT per byte of weights on an H100, s27).

Per shape of `bench_families.SHAPES` (random bf16 weights), one request decodes greedily on an
engine with enforce_eager (every kernel launched on its own, so that the profiler sees each);
torch.profiler records `--steps` decode steps, and the kernels' device time is summed by name.
Prints, per shape: device milliseconds a step, its weight GB and GB/s, and the kernels that take
the most device time a step (calls a step, ms a step, share).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_family_kernels.py --out DIR \
        [--shapes llama-3-8b,qwen3-8b,gemma-2-9b] [--steps 16] [--batch 1]

Writes DIR/family_kernels.json. A profile, not a figure (TPOT is bench_families.py's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_families import SHAPES, build, weight_bytes  # noqa: E402
from bench_gpu_engine import random_prompts  # noqa: E402

TOP = 14  # kernels printed a shape


def engine_for(model, batch: int):
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm import LLM
    from specdec.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max(batch, 8),
        max_model_len=512,
        enforce_eager=True,
        async_scheduling=False,
        num_kv_blocks=max(batch, 8) * 8,  # 128 tokens a request: the weights keep the memory
    )
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(config, None, model=model, tokenizer=None)
    return llm


def kernel_times(profile) -> dict[str, tuple[int, float]]:
    """{kernel name: (calls, device microseconds)} of every CUDA kernel the profile saw."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in profile.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        if name.startswith(("Memcpy", "Memset")):
            name = name.split(" ")[0]
        entry = totals[name]
        entry[0] += 1
        entry[1] += event.device_time
    return {name: (calls, us) for name, (calls, us) in totals.items()}


def probe_shape(name: str, batch: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from specdec.sampling import SamplingParams

    config = SHAPES[name]
    model = build(config, "cuda")
    total, active = weight_bytes(model, config)
    llm = engine_for(model, batch)
    prompts = random_prompts(batch, config["vocab_size"], seed=batch, length=64)

    def run(engine, tokens: int):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        engine.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()

    run(llm, 4)  # compiles, allocations
    with profile(activities=[ProfilerActivity.CUDA]) as short:
        run(llm, 1)  # the prefill alone
    with profile(activities=[ProfilerActivity.CUDA]) as full:
        run(llm, 1 + steps)
    one, many = kernel_times(short), kernel_times(full)
    per_step = {}
    for kernel, (calls, us) in many.items():
        calls0, us0 = one.get(kernel, (0, 0.0))
        if calls - calls0 > 0:
            per_step[kernel] = ((calls - calls0) / steps, (us - us0) / steps / 1e3)
    step_ms = sum(ms for _, ms in per_step.values())
    ranked = sorted(per_step.items(), key=lambda item: -item[1][1])
    row = {
        "weight_gb": total / 1e9,
        "active_weight_gb": active / 1e9,
        "device_ms_per_step": step_ms,
        "gb_per_s": active / 1e9 / (step_ms / 1e3) if step_ms else None,
        "kernels_per_step": sum(calls for calls, _ in per_step.values()),
        "top": [
            {"kernel": k[:160], "calls": round(c, 2), "ms": round(ms, 4), "share": ms / step_ms}
            for k, (c, ms) in ranked[:40]
        ],
    }
    print(
        f"[kernels] {name} b{batch}: {step_ms:.3f} device ms a step, {row['weight_gb']:.2f} GB, "
        f"{row['gb_per_s']:.0f} GB/s, {row['kernels_per_step']:.0f} kernels a step",
        flush=True,
    )
    for item in row["top"][:TOP]:
        share, calls = item["share"], item["calls"]
        print(f"   {item['ms']:8.4f} ms {share:6.1%} x{calls:<6g} {item['kernel'][:110]}")
    del llm, model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="llama-3-8b,qwen3-8b,gemma-2-9b")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
        }
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        result[name] = probe_shape(name, args.batch, args.steps)
        (out / "family_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
