"""Where the first engine step of a speculative generate call spends its time, against plain.

The first `step` of a generate call (prefill, first token, and with speculation the drafter's
catch-up and the start of device rounds) cost 37-40 ms with the shipped EAGLE head against
20-22 ms plain on the H200 (benchmarks/results/h200-2026-12-01-s9, `steps.slowest_ms`). This
probe builds both engines as `bench_spec_round.py` does (SmolLM2 GGUF, held-out prompts), warms
them up, then times the parts of the first step of one more call, each bracketed by device
synchronisations (so the parts add up to the step; overlap inside the step is lost), and keeps a
torch.profiler table of that step (the ops with the most host time).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_first_step.py --out DIR \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--batches 1,32]

Writes DIR/first_step.json. Not a figure for BENCHMARKS.md by itself: a profile.
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
EARLY = 4  # steps timed at the start of each bare call
sys.path.insert(0, str(HERE.parent))

from bench_spec_round import load_smollm2, make_engine, smollm2_batch  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PartTimer:
    """Wraps attributes (obj, name) so each call's synchronised wall time adds to a part."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.active = False
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)
        timer = self

        def timed(*args, **kwargs):
            if not timer.active:
                return inner(*args, **kwargs)
            sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            sync()
            timer.ms[label] = timer.ms.get(label, 0.0) + (time.perf_counter() - start) * 1e3
            timer.calls[label] = timer.calls.get(label, 0) + 1
            return out

        self._undo.append((obj, name, inner))
        setattr(obj, name, timed)

    def restore(self) -> None:
        for obj, name, inner in reversed(self._undo):
            setattr(obj, name, inner)
        self._undo.clear()


def probe(llm, prompts, params, label: str, calls: int = 1, profile: bool = True) -> dict:
    import specdec.engine.llm_engine as engine_module

    engine = llm.engine
    for _ in range(3):  # warm-up: graphs captured, rounds' buffers made
        llm.generate(prompts, params, use_tqdm=False)
    timer = PartTimer()
    timer.wrap(engine, "_schedule", "schedule")
    timer.wrap(engine.runner, "run_with_features", "target forward (prefill)")
    timer.wrap(engine.emitter, "emit", "emit (sample)")
    timer.wrap(engine, "_commit", "commit")
    timer.wrap(engine_module, "propose", "propose")
    timer.wrap(engine_module, "deliver_features", "deliver features (drafter observe)")
    if engine.drafter is not None:
        timer.wrap(engine, "_enter_rounds", "enter rounds (total)")
        if engine._rounds is not None:
            timer.wrap(engine._rounds, "begin", "rounds.begin")
            timer.wrap(engine._rounds.drafting, "begin", "drafting.begin")
        from specdec.models.attention import AttentionMetadata, AttentionPlan

        drafter = engine.drafter
        for obj, name in (
            (drafter, "_catch_up"),
            (drafter, "_step"),
            (drafter, "_decode_step"),
            (getattr(drafter, "head", None), "forward_paged"),
            (getattr(drafter, "head", None), "project_features"),
            (getattr(drafter, "allocator", None), "grow"),
            (AttentionMetadata, "build"),
            (AttentionPlan, "build"),
        ):
            if obj is not None and hasattr(obj, name):
                timer.wrap(obj, name, f"{getattr(obj, '__name__', type(obj).__name__)}.{name}")
    inner_step = engine.step
    first: dict = {}
    state = {"n": 0}
    profiler_table: list[str] = []

    def step(*args, **kwargs):
        state["n"] += 1
        if state["n"] != 1:
            return inner_step(*args, **kwargs)
        timer.active = True
        sync()
        start = time.perf_counter()
        if not profile:
            out = inner_step(*args, **kwargs)
            sync()
            first["step_ms"] = (time.perf_counter() - start) * 1e3
            timer.active = False
            return out
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = inner_step(*args, **kwargs)
        sync()
        first["step_ms"] = (time.perf_counter() - start) * 1e3
        timer.active = False
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        profiler_table.extend(table.splitlines())
        return out

    engine.step = step
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    total_ms = (time.perf_counter() - start) * 1e3
    engine.step = inner_step
    timer.restore()
    # The first steps again without the profiler or the part timers' syncs: each of the
    # first `EARLY` steps of `calls` calls, synchronised at the step's ends only.
    early: list[list[float]] = []

    def bare(*args, **kwargs):
        state["n"] += 1
        if state["n"] > EARLY:
            return inner_step(*args, **kwargs)
        sync()
        t0 = time.perf_counter()
        out = inner_step(*args, **kwargs)
        sync()
        early[-1].append((time.perf_counter() - t0) * 1e3)
        return out

    engine.step = bare
    call_ms = []
    for _ in range(calls):
        state["n"] = 0
        early.append([])
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        call_ms.append((time.perf_counter() - t0) * 1e3)
    engine.step = inner_step
    first_steps = [steps[0] for steps in early]
    row = {
        "first_step_profiled_ms": round(first["step_ms"], 3),
        "first_step_bare_ms": round(statistics.median(first_steps), 3),
        "early_steps_bare_ms": [[round(t, 3) for t in steps] for steps in early],
        "call_bare_ms": [round(t, 3) for t in call_ms],
        "call_ms_profiled": round(total_ms, 3),
        "parts_ms": {k: round(v, 3) for k, v in timer.ms.items()},
        "parts_calls": timer.calls,
        "profiler_top_self_cpu": profiler_table,
    }
    brief = {k: v for k, v in row.items() if k != "profiler_top_self_cpu"}
    print(f"[first-step] {label}: {json.dumps(brief)}", flush=True)
    print("\n".join(profiler_table[:20]), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=1, help="bare calls timed (median)")
    parser.add_argument("--no-profiler", action="store_true", help="parts only, no profiler")
    args = parser.parse_args()
    model, tokenizer, encoded, head = load_smollm2(args.gguf, args.device)
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts, blocks, params = smollm2_batch(encoded, batch, args.output_len, 0.0)
        for name, spec in (
            ("plain", None),
            ("eagle adaptive K<=4", {**head, "num_speculative_tokens": 4, "adaptive": True}),
        ):
            llm = make_engine(
                model, tokenizer, spec, device=args.device, max_num_seqs=batch,
                max_model_len=1024, blocks=blocks,
            )  # fmt: skip
            label = f"b{batch} {name}"
            results[label] = probe(
                llm, prompts, params, label, args.calls, profile=not args.no_profiler
            )
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_step.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'first_step.json'}")


if __name__ == "__main__":
    main()
