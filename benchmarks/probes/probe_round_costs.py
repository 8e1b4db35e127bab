"""A device round's cost split into its GPU time and the host's work, against a plain step.

In steady state a K = 2 round at batch 32 costs 1.49 ms between launches against 0.97 ms for a
plain overlapped step (benchmarks/results/h200-2026-12-01-s9, `policy_costs_ms`), and a K = 0
round already 1.27 ms. This probe says which side binds: for the SmolLM2 GGUF with the shipped
head, K pinned to 1, 2 and 4 (and the plain engine), after warm-up generate calls, it records
- the interval between round launches the policy measured (its median cost),
- the GPU time of every captured round graph and of the plain decode graph (replayed alone),
- the host time of the round loop's parts per call (launch, read, commit; no syncs added).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_round_costs.py --out DIR \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--batches 1,32]

Writes DIR/round_costs.json (a profile, not a BENCHMARKS.md figure by itself).
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

from bench_spec_round import load_smollm2, make_engine, replay_ms, smollm2_batch  # noqa: E402


class HostTimer:
    """Host seconds per call of wrapped methods (no synchronisation added)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)
        store = self.seconds.setdefault(label, [])

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            store.append(time.perf_counter() - start)
            return out

        setattr(obj, name, timed)

    def summary(self) -> dict:
        out = {}
        for label, values in self.seconds.items():
            if values:
                ordered = sorted(values)
                out[label] = {
                    "calls": len(values),
                    "median_ms": round(ordered[len(ordered) // 2] * 1e3, 4),
                    "total_ms": round(sum(values) * 1e3, 3),
                }
        return out


def graph_caches(engine) -> list[tuple[str, object]]:
    """Every GraphCache reachable from the engine through specdec objects' attributes (three
    levels down), by the path that reached it."""
    from specdec.runner.cuda_graph import GraphCache

    found, seen = [], set()

    def visit(path: str, obj, depth: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, GraphCache):
            found.append((path, obj))
            return
        if depth == 0 or not type(obj).__module__.startswith("specdec"):
            return
        for name, value in getattr(obj, "__dict__", {}).items():
            visit(f"{path}.{name}", value, depth - 1)

    visit("engine", engine, 4)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    model, tokenizer, encoded, head = load_smollm2(args.gguf, "cuda")
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts, blocks, params = smollm2_batch(encoded, batch, args.output_len, 0.0)
        configs = {"plain": None}
        for k in [int(k) for k in args.ks.split(",")]:
            configs[f"K={k}"] = {**head, "num_speculative_tokens": k, "adaptive": False}
        for name, spec in configs.items():
            llm = make_engine(
                model, tokenizer, spec, device="cuda", max_num_seqs=batch, max_model_len=1024,
                blocks=blocks,
            )  # fmt: skip
            engine = llm.engine
            for _ in range(3):
                llm.generate(prompts, params, use_tqdm=False)
            timer = HostTimer()
            timer.wrap(engine, "_commit", "commit")
            if engine._rounds is not None:
                timer.wrap(engine._rounds, "launch", "rounds.launch")
                timer.wrap(engine._rounds, "read", "rounds.read")
                timer.wrap(engine._rounds.drafting, "prepare", "drafting.prepare")
            timer.wrap(engine, "step", "engine.step")
            torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            row = {
                "seconds": round(seconds, 5),
                "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                "host": timer.summary(),
                "loop": llm.get_metrics()["loop"],
            }
            policy = getattr(engine, "policy", None)
            if policy is not None:
                row["policy_costs_ms"] = {
                    f"bucket {b} K={k}": round(sec * 1e3, 4)
                    for (b, k), (sec, _) in sorted(policy.costs().items())
                }
            graphs = {}
            for owner, cache in graph_caches(engine):
                for key, (graph, _) in list(cache.graphs.items()):
                    graphs[f"{owner} {key}"] = replay_ms(graph, "cuda")
            row["graph_replay_ms"] = {k: round(v, 4) for k, v in graphs.items() if v is not None}
            results[f"b{batch} {name}"] = row
            print(f"[round-costs] b{batch} {name}: {json.dumps(row)}", flush=True)
            del llm, engine
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "round_costs.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'round_costs.json'}")


if __name__ == "__main__":
    main()
