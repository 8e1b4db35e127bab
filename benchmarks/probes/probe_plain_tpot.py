"""Plain decoding TPOT of a random-weight model (SmolLM2's shape by default) at batch 1 and 64,
with whatever `specdec` is on the path: run it with two source trees one after the other in
one lease to compare them (e.g. before and after a change of the decode step).

`PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_plain_tpot.py --out FILE.json
[--shape smollm2-135m] [--batches 1,64] [--new-tokens 64] [--max-model-len N]`
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_gpu_engine import build_ours, engine_tpot, make_llm, random_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--cublas", action="store_true", help="force cuBLAS for every product (if supported)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len (default 1024; past 2,048 the attention kernels merge "
        "at split-KV partition edges: the cost of s33's long-context replay)",
    )
    parser.add_argument(
        "--decode-max-block-m",
        type=int,
        default=None,
        help="the decode kernels' most query rows a program (128: before the s22 row tiles)",
    )
    args = parser.parse_args()
    import specdec

    if args.decode_max_block_m is not None:
        from specdec.models import attention_tiles

        attention_tiles.DECODE_MAX_BLOCK_M = args.decode_max_block_m

    try:
        from specdec.models import linear as linear_module
    except ImportError:  # a source tree from before the row-invariant products
        linear_module = None
    if linear_module is not None and args.cublas:
        linear_module.ROW_INVARIANT_ON_CUDA = False

    model = build_ours(args.shape)
    result = {"specdec": specdec.__file__, "shape": args.shape, "tpot_ms": {}}
    result["decode_max_block_m"] = args.decode_max_block_m
    result["max_model_len"] = args.max_model_len
    for batch in [int(b) for b in args.batches.split(",")]:
        sizing = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
        llm = make_llm(model, None, max_num_seqs=64, **sizing)
        prompts = random_prompts(batch, model.config.vocab_size, seed=batch)
        result["tpot_ms"][batch] = engine_tpot(llm, prompts, args.new_tokens)["tpot_ms"]
        print(
            specdec.__file__, "batch", batch, round(result["tpot_ms"][batch], 4), "ms", flush=True
        )
        del llm
        torch.cuda.empty_cache()
    if linear_module is not None:
        result["cublas_rows"] = {str(k[:2]): v for k, v in linear_module._CUBLAS_ROWS.items()}
        result["cublas_forced"] = args.cublas
        print("cuBLAS kept for", result["cublas_rows"], "forced" if args.cublas else "", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
