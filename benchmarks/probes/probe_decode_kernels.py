"""What a decode step's GPU time is made of: a diagnostic, not a benchmark.

    python benchmarks/probes/probe_decode_kernels.py --out DIR [--shapes llama-3-8b]
        [--batches 1,64]

For each shape and batch: (1) the decode step run eagerly (the same kernels the CUDA graph
replays) under `torch.profiler`, its kernels summed by name, with the replay time beside it;
(2) every weight matrix of the step (q/k/v, o, gate/up, down, LM head) multiplied alone by
[M, D] activations for M in --ms, through `F.linear` (cuBLAS), as milliseconds and the fraction
of the weight-read floor at --bandwidth TB/s. Cycling through the layers' own weights keeps the
L2 cache from serving them. Writes DIR/decode_kernels.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_gpu_engine

from bench_gpu_engine import build_ours, cuda_ms


def step_census(model, batch: int, context: int) -> dict:
    """Kernels of one eager decode step at `batch` sequences of `context` cached tokens."""
    from torch.profiler import ProfilerActivity, profile

    from specdec.runner.model_runner import PagedModelRunner

    blocks_per_seq = -(-(context + 1) // 16)
    runner = PagedModelRunner(
        model,
        batch * blocks_per_seq + 8,
        16,
        max_num_seqs=batch,
        max_model_len=blocks_per_seq * 16,
    )
    graphs = runner.graphs
    tokens = [[7] for _ in range(batch)]
    starts = [context] * batch
    blocks = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    replay_ms = cuda_ms(lambda: graphs.run(tokens, starts, blocks), 50)
    graphs.use_graphs = False
    eager_ms = cuda_ms(lambda: graphs.run(tokens, starts, blocks), 10)
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graphs.run(tokens, starts, blocks)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        if event.device_type.name != "CUDA" or event.self_device_time_total <= 0:
            continue
        kernels[event.key][0] += event.self_device_time_total / steps / 1e3
        kernels[event.key][1] += event.count // steps
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    total = sum(ms for ms, _ in kernels.values())
    del runner
    torch.cuda.empty_cache()
    return {
        "replay_ms": round(replay_ms, 4),
        "eager_ms": round(eager_ms, 4),
        "kernel_ms_total": round(total, 4),
        "kernels": [
            {"name": name[:160], "ms_per_step": round(ms, 4), "calls": calls}
            for name, (ms, calls) in rows
        ],
    }


def gemm_table(model, ms: list[int], bandwidth_tbs: float) -> dict:
    """F.linear time per weight kind and M, cycling through all layers' weights."""
    layers = model.model.layers
    kinds = {
        "qkv": [layer.self_attn.qkv_proj.weight for layer in layers],
        "o": [layer.self_attn.o_proj.weight for layer in layers],
        "gate_up": [layer.mlp.gate_up_proj.weight for layer in layers],
        "down": [layer.mlp.down_proj.weight for layer in layers],
        "lm_head": [model.lm_head_weight],
    }
    table = {}
    for kind, weights in kinds.items():
        n, k = weights[0].shape
        floor_ms = weights[0].numel() * weights[0].element_size() / (bandwidth_tbs * 1e9)
        for m in ms:
            x = torch.randn(m, k, dtype=weights[0].dtype, device="cuda")
            counter = iter(range(10**9))

            def call(x=x, weights=weights, counter=counter):
                return F.linear(x, weights[next(counter) % len(weights)])

            t = cuda_ms(call, 20 * len(weights) if len(weights) > 1 else 100)
            table[f"{kind} [{n}x{k}] M={m}"] = {
                "ms": round(t, 4),
                "floor_ms": round(floor_ms, 4),
                "of_floor": round(floor_ms / t, 3),
            }
            print(kind, n, k, m, table[f"{kind} [{n}x{k}] M={m}"], flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="llama-3-8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--ms", default="1,8,16,32,64")
    parser.add_argument("--bandwidth", type=float, default=4.28)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for shape in args.shapes.split(","):
        model = build_ours(shape)
        model.fuse_projections()
        entry: dict = {}
        for batch in (int(b) for b in args.batches.split(",")):
            entry[f"b{batch}"] = census = step_census(model, batch, args.context)
            print(shape, batch, {k: v for k, v in census.items() if k != "kernels"}, flush=True)
            for row in census["kernels"][:14]:
                print("   ", row, flush=True)
        entry["gemms"] = gemm_table(model, [int(m) for m in args.ms.split(",")], args.bandwidth)
        report[shape] = entry
        del model
        torch.cuda.empty_cache()
        (out / "decode_kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
