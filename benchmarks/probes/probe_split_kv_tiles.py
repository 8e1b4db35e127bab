"""Split-KV launch shapes at long context on the GPU: the first pass's keys per partition, keys
per online-softmax step, warps and pipeline stages, timed per layer at batch 1 (Llama-3-8B
attention shape, bf16, 16-token blocks scattered at random) for 1 and 5 query tokens, against
the K/V-read floor (bytes / the copy bandwidth measured in the same run).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_split_kv_tiles.py --out DIR \\
        [--context 131072] [--partitions 512,1024,2048] [--block-ns 64,128] [--warps 4,8] \\
        [--stages 0,1,2,3]

Stage 0 means Triton's default. Each variant's output is compared with the default tiles' (bit
for bit where partition and step size match: warps and stages must not change the bits). Writes
DIR/split_kv_tiles.json incrementally (rows sorted by time at the end). A probe: never imported
by tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_gpu_engine import cuda_ms, log  # the benchmarks' one CUDA-event timer
from bench_long_attention import HEAD_DIM, NUM_HEADS, copy_bandwidth_gbs, paged_cache, randn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--partitions", default="512,1024,2048")
    parser.add_argument("--block-ns", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--queries", default="1,5")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_split_kv_tiles.py needs a CUDA device")
    from specdec.models.attention import DecodeMetadata
    from specdec.models.split_kv_triton import (
        SplitKVTiles,
        default_tiles,
        split_kv_decode_attention_triton,
    )

    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "split_kv_tiles.json"
    copy_gbs = copy_bandwidth_gbs()
    length = args.context
    k_cache, v_cache, table = paged_cache(length, seed=20)
    kv_bytes = 2 * length * k_cache.shape[2] * HEAD_DIM * k_cache.element_size()
    floor_ms = kv_bytes / (copy_gbs * 1e9) * 1e3
    scale = HEAD_DIM**-0.5
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "context": length,
        "copy_bandwidth_gbs": copy_gbs,
        "kv_read_floor_ms": floor_ms,
        "default_tiles": repr(default_tiles()),
        "rows": [],
    }
    for q in ints(args.queries):
        query = randn(q, NUM_HEADS, HEAD_DIM, seed=21)

        def meta_for(partition: int, q: int = q) -> DecodeMetadata:
            return DecodeMetadata(
                block_tables=table,
                context_lens=torch.tensor([length], device="cuda"),
                query_lens=torch.tensor([q], device="cuda"),
                slot_mapping=torch.full((q,), -1, device="cuda"),
                query_per_seq=q,
                num_partitions=-(-length // partition),
            )

        reference = split_kv_decode_attention_triton(
            query, k_cache, v_cache, meta_for(default_tiles().partition), scale
        )
        grid = itertools.product(
            ints(args.partitions), ints(args.block_ns), ints(args.warps), ints(args.stages)
        )
        for partition, block_n, warps, stages in grid:
            if partition % block_n:
                continue
            tiles = SplitKVTiles(partition, block_n, warps, stages or None)
            meta = meta_for(partition)
            row = {"query_tokens": q, "partition": partition, "block_n": block_n}
            row |= {"num_warps": warps, "num_stages": stages or "default"}
            try:
                out = split_kv_decode_attention_triton(query, k_cache, v_cache, meta, scale, tiles)
                ms = cuda_ms(
                    lambda query=query, meta=meta, tiles=tiles: split_kv_decode_attention_triton(
                        query, k_cache, v_cache, meta, scale, tiles
                    ),
                    args.iters,
                )
            except Exception as error:  # a shape the compiler refuses (e.g. out of shared memory)
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                log(row)
                result["rows"].append(row)
                continue
            same_order = (partition, block_n) == (
                default_tiles().partition,
                default_tiles().block_n,
            )
            row |= {
                "ms_per_layer": ms,
                "ratio_to_floor": ms / floor_ms,
                "bits_equal_default": bool(torch.equal(out, reference)),
                "same_reduction_order_as_default": same_order,
                "max_abs_diff_default": float((out.float() - reference.float()).abs().max()),
            }
            log(row)
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=2))
    result["rows"].sort(key=lambda r: (r["query_tokens"], r.get("ms_per_layer", 1e9)))
    path.write_text(json.dumps(result, indent=2))
    for q in ints(args.queries):
        best = [r for r in result["rows"] if r["query_tokens"] == q and "ms_per_layer" in r][:3]
        log(f"Q={q} best: {best}")


if __name__ == "__main__":
    main()
