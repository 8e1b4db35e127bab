"""Which host synchronisations the device-round loop makes while requests join it, and what a
join's admission costs the host (issue 34: at c = 16 the rounds' `admit` took 3.5 ms of host
time a call, 17% of the run, in `probe_joining_rounds.py`, s44, H100).

A tiny Llama (tests' fixtures, random weights) with a briefly trained EAGLE head on CUDA; requests
of 40-token prompts keep `--concurrency` in flight through `--max-num-seqs` slots, so that they
join the running rounds. After a warm-up run, a second run with
`torch.cuda.set_sync_debug_mode("warn")`: every synchronising CUDA call warns, and each warning's
innermost specdec frames are counted. A third run times `DeviceRounds.admit` and the EAGLE
drafting's admission parts on the host (no synchronisation added).

    PYTHONPATH=src:tests:benchmarks python3 benchmarks/probes/probe_round_syncs.py --out DIR

Writes DIR/round_syncs.json (a profile, not a figure).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from probe_joining_rounds import drive, timed_parts, wrapper


def specdec_frames(stack: list[traceback.FrameSummary], depth: int = 4) -> str:
    frames = [f for f in stack if "/specdec/" in f.filename and "warnings" not in f.filename]
    return " <- ".join(
        f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-depth:])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test (no sync mode)")
    args = parser.parse_args()

    from eagle_fixtures import trained_head
    from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
    from specdec.drafters.eagle import device as eagle_device
    from specdec.drafters.eagle import drafter as eagle_drafter
    from specdec.engine import device_round
    from specdec.engine.llm import LLM

    root = Path(tempfile.mkdtemp())
    model_dir = save_hf_model(make_hf_model("llama"), root / "model")
    head_dir = trained_head(model_dir, root / "head")
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
    llm = LLM(
        str(model_dir),
        speculative_config=spec,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=256,
    )
    llm.engine.warm_up(progress=False)
    prompts = prompt_tokens(97, [40] * args.requests, seed=5)
    result: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}}
    result["warm_s"] = drive(llm, prompts, args.concurrency, args.max_tokens)

    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        seen[f"{str(message)[:60]} @ {specdec_frames(traceback.extract_stack())}"] += 1

    original = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        result["sync_run_s"] = drive(llm, prompts, args.concurrency, args.max_tokens)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    result["syncs"] = dict(seen.most_common())
    result["loop"] = llm.get_metrics()["loop"]
    print("[syncs]", json.dumps(result["loop"]))
    for where, count in seen.most_common(30):
        print(f"[syncs] {count:6d}  {where}")

    from specdec.drafters.eagle import head as eagle_head
    from specdec.models import attention

    for synchronise in (False, True):
        totals, counts, restore = timed_parts(synchronise)
        extra: list = []
        wrap = wrapper(synchronise, totals, counts, extra)
        wrap(eagle_device.EagleDeviceDrafting, "admit", "eagle.admit")
        wrap(eagle_drafter.EagleDrafter, "_catch_up", "eagle._catch_up")
        wrap(eagle_drafter.EagleDrafter, "_step", "eagle._step")
        wrap(eagle_head.EagleHead, "forward_paged", "head.forward_paged")
        wrap(eagle_head.EagleHead, "project_features", "head.project_features")
        wrap(attention.AttentionMetadata, "build", "AttentionMetadata.build")
        wrap(attention, "paged_prefill_attention", "paged_prefill_attention")
        wrap(device_round.DeviceRounds, "_write_rules", "rounds._write_rules")
        try:
            seconds = drive(llm, prompts, args.concurrency, args.max_tokens)
        finally:
            for owner, name, inner in reversed(extra):
                setattr(owner, name, inner)
            restore()
        label = "parts_synchronised" if synchronise else "parts_host"
        result[label] = {"run_s": round(seconds, 3)} | {
            k: [n, round(totals[k] * 1e3, 1), round(totals[k] / n * 1e6)]
            for k, n in sorted(counts.items())
        }
        for k, v in result[label].items():
            print(f"[{label}] {k:>26}: {v}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "round_syncs.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
