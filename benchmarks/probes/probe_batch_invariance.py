# ruff: noqa: B023  (closures are called inside the loops that define them)
"""Batch invariance on CUDA: which parts of a step make a row's value depend on what shares it.

Parts (`--parts`, comma-separated):
- `dot`: (1) the row-invariant GEMM (`models/linear_triton.py`): is a row's output the same bits
  for every tile shape (BLOCK_M, BLOCK_N, BLOCK_K, warps) and every row count? (2) cuBLAS
  (`F.linear`): from which row count on does a row differ from the row alone? (3) time of
  both at the row counts of decode (1, 8, 64), verify (320) and prefill (2048) on the SmolLM2 and
  Llama-3-8B weight shapes.
- `attention`: the decode kernel's row for a token alone (Q = 1), as the last row of a verify
  (Q = 5) and of a 16-token graphed-prefill chunk, beside other sequences; the prefill kernel's
  row for the same token; split-KV with one partition.
- `engine`: seeded requests on a random-weight model of SmolLM2's shape (bf16, graphs): each
  alone against joining a running engine at random steps, a closed batch, and preemption;
  plain decoding and the default speculation (the shipped head, adaptive K, the default
  verifier); greedy speculative against greedy plain with half the requests joining mid-run.
  With `--toggle-linear`, also with `ROW_INVARIANT_ON_CUDA = False` (cuBLAS).
- `bisect`: the replay fixtures' requests alone against a closed batch and arrivals (tokens,
  and logprobs bit for bit) under engine settings that each turn one part off (graphs, the
  overlapped loop, graphed prefill, cuBLAS): on random weights and on `--model`; and alone on
  one reused engine against alone on fresh ones (a read of cache slots outside the context).
- `capture`: cuBLAS rows of an M-row product replayed from a CUDA graph against the rows alone
  (eager, and each replayed from a one-row graph), for the shapes of `--capture-families`.
- `tpot`: plain TPOT at batch 1 and 64 (SmolLM2 shape), with the row-invariant GEMM and with
  cuBLAS, in this process.

`PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_batch_invariance.py --out FILE.json
[--parts dot,attention,engine,tpot] [--toggle-linear]`
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch

RESULTS: dict = {}
DEVICE = "cuda"
SHAPE = "smollm2-135m"


def log(*args) -> None:
    print(*args, flush=True)


def median_ms(fn, repeats: int = 50, warmup: int = 25) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=repeats, return_mode="median")


# --------------------------------------------------------------------------- dot
WEIGHT_SHAPES = {
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "llama-3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    # the replay tests' tiny Llama (its cuBLAS check passes, yet with cuBLAS its float test
    # model's log-probabilities differed on the H100 and H200 in s26-s27; Triton: equal)
    "tiny": [(64, 64), (32, 64), (96, 64), (64, 96), (128, 64), (192, 64)],
}
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the first is linear_tile's
    (16, 64, 128, 4, 4),
    (16, 64, 64, 4, 4),
    (32, 64, 128, 4, 4),
    (16, 32, 128, 4, 4),
    (16, 128, 64, 4, 4),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 256, 64, 8, 3),
]


def run_tile(x, weight, tile):
    import triton

    from specdec.models.linear_triton import _linear_kernel

    block_m, block_n, block_k, warps, stages = tile
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))
    _linear_kernel[grid](
        x, weight, weight, out, rows, cols, x.stride(0), out.stride(0),
        DEPTH=depth, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=False, IEEE=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def part_dot() -> None:
    import torch.nn.functional as F

    from specdec.models.linear_triton import linear_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {"tiles": {}, "cublas_first_differing_rows": {}, "times_ms": {}}
    for family, shapes in WEIGHT_SHAPES.items():
        for cols, depth in shapes:
            name = f"{family} {cols}x{depth}"
            weight = torch.randn(cols, depth, device="cuda", generator=generator).bfloat16() * 0.02
            x = torch.randn(512, depth, device="cuda", generator=generator).bfloat16()
            # (1) tiles and row counts
            base = run_tile(x, weight, TILES[0])
            alone = torch.cat([run_tile(x[i : i + 1], weight, TILES[0]) for i in range(8)])
            tiles = {"rows alone == in 512": bool(torch.equal(alone, base[:8]))}
            for tile in TILES[1:]:
                out = run_tile(x, weight, tile)
                tiles[str(tile)] = float((out != base).float().mean())  # fraction differing
            result["tiles"][name] = tiles
            # (2) cuBLAS: rows against the row alone
            ref = torch.cat([F.linear(x[i : i + 1], weight) for i in range(8)])
            differing = []
            for rows in (2, 4, 8, 16, 32, 64, 80, 128, 320, 512):
                out = F.linear(x[:rows], weight)
                if not torch.equal(out[: min(rows, 8)], ref[: min(rows, 8)]):
                    differing.append(rows)
            result["cublas_first_differing_rows"][name] = differing
            # (3) times
            times = {}
            for rows in (1, 8, 64, 320, 2048):
                xr = torch.randn(rows, depth, device="cuda", generator=generator).bfloat16()
                times[rows] = {
                    "cublas": median_ms(lambda xr=xr: F.linear(xr, weight)),
                    "triton": median_ms(lambda xr=xr: linear_triton(xr, weight)),
                    "tile 64x64x64": median_ms(lambda xr=xr: run_tile(xr, weight, TILES[5])),
                    "tile 128x128x64": median_ms(lambda xr=xr: run_tile(xr, weight, TILES[7])),
                }
            result["times_ms"][name] = times
            log(name, tiles, "cuBLAS differs at", differing)
            log("   ", {r: {k: round(v * 1e3, 1) for k, v in t.items()} for r, t in times.items()})
    RESULTS["dot"] = result


# --------------------------------------------------------------------------- tune
TUNE_SPACE = {  # candidate tiles by row-count class: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    "small": [
        (16, n, k, w, st)
        for n in (16, 32, 64)
        for k in (64, 128, 256)
        for w in (2, 4)
        for st in (3, 5)
    ],
    "mid": [
        (m, n, k, 4, st)
        for m in (16, 32, 64)
        for n in (32, 64, 128)
        for k in (64, 128)
        for st in (3, 4)
    ],
    "large": [
        (m, n, 64, w, st)
        for m in (64, 128)
        for n in (64, 128, 256)
        for w in (4, 8)
        for st in (3, 4)
    ],
}


def graphed_ms(fn, launches: int = 20) -> float:
    """Milliseconds per call of fn replayed from a CUDA graph of `launches` calls (the decode
    step's situation: no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return median_ms(graph.replay, repeats=15, warmup=3) / launches


def part_tune() -> None:
    import torch.nn.functional as F

    from specdec.models.linear_triton import LinearTile, launch_linear, linear_tile

    generator = torch.Generator(device="cuda").manual_seed(2)
    result = {}
    for family, shapes in WEIGHT_SHAPES.items():
        for cols, depth in shapes:
            name = f"{family} {cols}x{depth}"
            weight = torch.randn(cols, depth, device="cuda", generator=generator).bfloat16()
            result[name] = {}
            for rows in (1, 16, 64, 320, 2048):
                if family == "llama-3-8b" and rows == 2048 and cols > 6144:
                    continue
                x = torch.randn(rows, depth, device="cuda", generator=generator).bfloat16()
                out = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
                space = "small" if rows <= 16 else "mid" if rows <= 128 else "large"
                times = {}
                for tile in TUNE_SPACE[space]:
                    t = LinearTile(*tile)
                    try:
                        times[tile] = graphed_ms(lambda t=t: launch_linear(x, weight, None, out, t))
                    except Exception as error:  # out of shared memory, say
                        times[tile] = float("inf")
                        log("   ", tile, type(error).__name__)
                best = min(times, key=times.get)
                current = linear_tile(rows, cols, depth)
                current_ms = graphed_ms(lambda: launch_linear(x, weight, None, out, current))
                cublas = graphed_ms(lambda: F.linear(x, weight))
                ranked = sorted(times, key=times.get)[:5]
                result[name][rows] = {
                    "cublas_us": cublas * 1e3,
                    "current_us": current_ms * 1e3,
                    "best_us": times[best] * 1e3,
                    "best": best,
                    "top5": [(list(t), round(times[t] * 1e3, 2)) for t in ranked],
                }
                log(
                    f"{name} M={rows}: cuBLAS {cublas * 1e3:.1f} us, current "
                    f"{current_ms * 1e3:.1f}, best {times[best] * 1e3:.1f} {best}"
                )
    RESULTS["tune"] = result


# --------------------------------------------------------------------------- attention
def part_attention() -> None:
    from specdec.models.attention import DecodeMetadata
    from specdec.models.fused_triton import paged_decode_attention_triton
    from specdec.models.prefill_attention_triton import paged_prefill_attention_triton
    from specdec.models.split_kv import split_kv_decode_attention

    generator = torch.Generator(device="cuda").manual_seed(1)
    result = {}
    for name, (heads, kv_heads, dim) in {"smollm2": (9, 3, 64), "llama-3-8b": (32, 8, 128)}.items():
        block, num_blocks, context = 16, 512, 300  # 4 sequences x 128 blocks
        shape = (num_blocks, block, kv_heads, dim)
        k_cache = torch.randn(shape, device="cuda", generator=generator).bfloat16()
        v_cache = torch.randn(shape, device="cuda", generator=generator).bfloat16()
        num_seqs = 4  # sequence s holds blocks s*32 ..
        tables = torch.stack(
            [torch.arange(s * 128, s * 128 + 128, device="cuda") for s in range(num_seqs)]
        ).int()
        queries = torch.randn(16, heads, dim, device="cuda", generator=generator).bfloat16()
        scale = dim**-0.5

        def decode(width: int, seqs: int):
            # sequence 0's last `width` query tokens (positions context-width .. context-1);
            # the other sequences bring random queries.
            q = torch.randn(seqs * width, heads, dim, device="cuda", generator=generator)
            q = q.bfloat16()
            q[:width] = queries[16 - width :]
            meta = DecodeMetadata(
                block_tables=tables[:seqs],
                context_lens=torch.full((seqs,), context, device="cuda", dtype=torch.int32),
                query_lens=torch.full((seqs,), width, device="cuda", dtype=torch.int32),
                slot_mapping=torch.full((seqs * width,), -1, device="cuda", dtype=torch.int64),
                query_per_seq=width,
            )
            return paged_decode_attention_triton(q, k_cache, v_cache, meta, scale)[:width], meta

        last_alone, _ = decode(1, 1)
        row = {}
        for width, seqs in ((1, 4), (5, 1), (5, 4), (16, 1), (16, 4), (3, 2)):
            out, _ = decode(width, seqs)
            row[f"Q={width} seqs={seqs}"] = bool(torch.equal(out[-1], last_alone[0]))
        # split-KV over one partition
        out16, meta16 = decode(16, 1)
        split_meta = DecodeMetadata(
            meta16.block_tables, meta16.context_lens, meta16.query_lens,
            meta16.slot_mapping, 16, num_partitions=4,
        )  # fmt: skip
        q16 = torch.zeros(16, heads, dim, device="cuda").bfloat16()
        q16[:] = queries
        split = split_kv_decode_attention(q16, k_cache, v_cache, split_meta, scale)
        row["split-KV (1 partition) == single pass, Q=16"] = bool(torch.equal(split, out16))
        # the prefill kernel over a 16-token chunk at the same positions
        pre = paged_prefill_attention_triton(
            queries.clone(), k_cache, v_cache,
            torch.tensor([0, 16], device="cuda", dtype=torch.int32),
            torch.tensor([context], device="cuda", dtype=torch.int32),
            tables[:1], 16, scale=scale,
        )  # fmt: skip
        row["prefill kernel row == decode row (Q=1)"] = bool(torch.equal(pre[-1], last_alone[0]))
        row["prefill kernel rows == decode rows (Q=16)"] = bool(torch.equal(pre, out16))
        row["prefill vs decode max abs diff"] = float((pre[-1] - last_alone[0]).abs().max())
        # every position of a long chunk, each against its decode row alone
        for length in (40, 700, 2000):
            tables_long = tables[:1]
            chunk_queries = torch.randn(
                length, heads, dim, device="cuda", generator=generator
            ).bfloat16()
            pre_long = paged_prefill_attention_triton(
                chunk_queries, k_cache, v_cache,
                torch.tensor([0, length], device="cuda", dtype=torch.int32),
                torch.tensor([length], device="cuda", dtype=torch.int32),
                tables_long, length, scale=scale,
            )  # fmt: skip
            equal = 0
            for pos in range(0, length, max(1, length // 40)):
                meta = DecodeMetadata(
                    block_tables=tables_long,
                    context_lens=torch.tensor([pos + 1], device="cuda", dtype=torch.int32),
                    query_lens=torch.ones(1, device="cuda", dtype=torch.int32),
                    slot_mapping=torch.full((1,), -1, device="cuda", dtype=torch.int64),
                    query_per_seq=1,
                )
                alone = paged_decode_attention_triton(
                    chunk_queries[pos : pos + 1], k_cache, v_cache, meta, scale
                )
                equal += bool(torch.equal(alone[0], pre_long[pos]))
            row[f"prefill chunk of {length}: rows equal to decode rows"] = (
                f"{equal}/{len(range(0, length, max(1, length // 40)))}"
            )
        result[name] = row
        log(name, row)
    RESULTS["attention"] = result


def part_prefill_tiles() -> None:
    """Which prefill-kernel tiles (BLOCK_M, warps) give every row the decode kernel's bits, on
    the Llama-3-8B attention shape (head_dim 128) and SmolLM2's."""
    from specdec.models import prefill_attention_triton as prefill_module
    from specdec.models.attention import DecodeMetadata
    from specdec.models.fused_triton import paged_decode_attention_triton

    generator = torch.Generator(device="cuda").manual_seed(3)
    original = prefill_module.prefill_tile
    result = {}
    for name, (heads, kv_heads, dim) in {"llama-3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}.items():
        k_cache = torch.randn(256, 16, kv_heads, dim, device="cuda", generator=generator).bfloat16()
        v_cache = torch.randn(256, 16, kv_heads, dim, device="cuda", generator=generator).bfloat16()
        table = torch.arange(256, device="cuda", dtype=torch.int32)[None]
        length = 1200
        queries = torch.randn(length, heads, dim, device="cuda", generator=generator).bfloat16()
        positions = list(range(0, length, 13))
        alone = []
        for pos in positions:
            meta = DecodeMetadata(
                block_tables=table,
                context_lens=torch.tensor([pos + 1], device="cuda", dtype=torch.int32),
                query_lens=torch.ones(1, device="cuda", dtype=torch.int32),
                slot_mapping=torch.full((1,), -1, device="cuda", dtype=torch.int64),
                query_per_seq=1,
            )
            alone.append(
                paged_decode_attention_triton(
                    queries[pos : pos + 1], k_cache, v_cache, meta, dim**-0.5
                )[0]
            )
        for tile in [(128, 8, 3), (128, 4, 3), (64, 4, 3), (64, 8, 2), (32, 4, 3), (16, 4, 3)]:
            prefill_module.prefill_tile = lambda dtype, block_d, tile=tile: tile
            out = prefill_module.paged_prefill_attention_triton(
                queries, k_cache, v_cache,
                torch.tensor([0, length], device="cuda", dtype=torch.int32),
                torch.tensor([length], device="cuda", dtype=torch.int32),
                table, length, scale=dim**-0.5,
            )  # fmt: skip
            equal = sum(bool(torch.equal(out[p], a)) for p, a in zip(positions, alone, strict=True))
            cu = torch.tensor([0, length], device="cuda", dtype=torch.int32)
            lens = torch.tensor([length], device="cuda", dtype=torch.int32)

            def run(cu=cu, lens=lens):
                return prefill_module.paged_prefill_attention_triton(
                    queries, k_cache, v_cache, cu, lens, table, length, scale=dim**-0.5
                )

            ms = median_ms(run, repeats=20, warmup=5)
            result[f"{name} {tile}"] = {"equal": f"{equal}/{len(positions)}", "ms": ms}
            log(name, tile, f"{equal}/{len(positions)}", f"{ms:.3f} ms")
        prefill_module.prefill_tile = original
    RESULTS["prefill_tiles"] = result


# --------------------------------------------------------------------------- engine
def make_engine(model, spec, max_num_seqs: int = 16, num_kv_blocks: int = 4096):
    """An engine on `model` (a built model object, or a GGUF / HF path loaded by the engine)."""
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm_engine import LLMEngine

    path = model if isinstance(model, str) else None
    config = EngineConfig(
        model=path,
        device=DEVICE,
        dtype="bfloat16",
        max_num_seqs=max_num_seqs,
        max_model_len=1024,
        num_kv_blocks=num_kv_blocks,
    )
    built = None if path else model
    return LLMEngine(config, SpeculativeConfig.from_dict(spec), model=built, tokenizer=None)


def run_arrivals(engine, prompts, params, arrivals, tag: str) -> dict[str, list[int]]:
    """Adds request i at step s for each (s, i) of `arrivals`, steps until all finish."""
    out: dict[str, list[int]] = {}
    pending = sorted(arrivals)
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            engine.add_request(prompts[i], params[i], request_id=f"{tag}{i}")
        for output in engine.step(only_finished=True):
            if output.finished:
                out[output.request_id[len(tag) :]] = output.outputs[0].token_ids
        step += 1
    return out


def part_engine(toggle: bool, model_path: str | None) -> None:
    from bench_gpu_engine import build_ours
    from specdec.drafters.default import DEFAULT_EAGLE_DIR
    from specdec.models import linear as linear_module
    from specdec.sampling import SamplingParams

    if model_path:  # a real checkpoint (the built-in GGUF): prompts from its vocabulary
        model, vocab = model_path, 49152
    else:
        model = build_ours(SHAPE, DEVICE)
        vocab = model.config.vocab_size
    rng = random.Random(0)
    lengths = [5, 9, 17, 30, 64, 100, 150, 200, 260, 7, 40, 12]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    n = len(prompts)
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=1000 + i, ignore_eos=True)
        for i in range(n)
    ]
    greedy = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in range(n)]
    spec_default = {"method": "eagle", "model": str(DEFAULT_EAGLE_DIR), "num_speculative_tokens": 4}
    if SHAPE == "tiny":  # the smoke test: the shipped head is SmolLM2's
        spec_default = {
            "method": "draft_model",
            "model": "truncated:1",
            "num_speculative_tokens": 4,
        }
    result = {}
    for row_invariant in [True, False] if toggle else [True]:
        linear_module.ROW_INVARIANT_ON_CUDA = row_invariant
        label = "row-invariant GEMM" if row_invariant else "cuBLAS"
        plain_solo = None
        for spec_name, spec in (("plain", None), ("default spec", spec_default)):
            t0 = time.perf_counter()
            engine = make_engine(model, spec)
            solo = {}
            for i in range(n):
                solo.update(run_arrivals(engine, prompts, sampled, [(0, i)], "solo"))
            joined = run_arrivals(
                engine, prompts, sampled, [(rng.randrange(0, 60), i) for i in range(n)], "join"
            )
            bursts = run_arrivals(
                engine, prompts, sampled, [(10 * (i // 4), i) for i in range(n)], "burst"
            )
            closed = run_arrivals(engine, prompts, sampled, [(0, i) for i in range(n)], "closed")
            loop = dataclasses.asdict(engine.loop_stats)
            del engine
            small = make_engine(model, spec, num_kv_blocks=40)
            pre = run_arrivals(small, prompts, sampled, [(0, i) for i in range(n)], "pre")
            preemptions = small.num_preemptions
            del small
            torch.cuda.empty_cache()

            def count(got):
                return sum(got[str(i)] == solo[str(i)] for i in range(n))

            row = {
                "joined": count(joined),
                "bursts": count(bursts),
                "closed": count(closed),
                "preempted": count(pre),
                "preemptions": preemptions,
                "of": n,
                "seconds": round(time.perf_counter() - t0, 1),
                "loop": loop,
            }
            if spec is None:
                plain_solo = solo
            else:
                row["solo equal to plain"] = sum(
                    solo[str(i)] == plain_solo[str(i)] for i in range(n)
                )
            result[f"{label} / {spec_name}"] = row
            log(label, spec_name, row)
        # greedy speculation against greedy plain, half the requests joining mid-run
        engine = make_engine(model, None, max_num_seqs=6)
        plain_g = run_arrivals(engine, prompts, greedy, [(0, i) for i in range(n)], "g")
        del engine
        engine = make_engine(model, spec_default, max_num_seqs=6)
        spec_g = run_arrivals(engine, prompts, greedy, [(0, i) for i in range(n)], "g")
        del engine
        torch.cuda.empty_cache()
        # each greedy request alone, plain and speculative: which side changed
        engine = make_engine(model, None)
        plain_alone = {}
        for i in range(n):
            plain_alone.update(run_arrivals(engine, prompts, greedy, [(0, i)], "ga"))
        del engine
        engine = make_engine(model, spec_default)
        spec_alone = {}
        for i in range(n):
            spec_alone.update(run_arrivals(engine, prompts, greedy, [(0, i)], "ga"))
        del engine
        torch.cuda.empty_cache()
        differing = []
        for i in map(str, range(n)):
            a, b = plain_g[i], spec_g[i]
            if a != b:
                first = next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
                differing.append({
                    "request": int(i), "first position": first, "plain": a[first:first + 3],
                    "spec": b[first:first + 3], "plain alone == plain batched": plain_alone[i] == a,
                    "spec alone == spec batched": spec_alone[i] == b,
                    "spec alone == plain alone": spec_alone[i] == plain_alone[i],
                })  # fmt: skip
        same = sum(plain_g[str(i)] == spec_g[str(i)] for i in range(n))
        result[f"{label} / greedy spec == greedy plain (max_num_seqs 6)"] = same
        result[f"{label} / greedy differing"] = differing
        result[f"{label} / greedy alone: spec == plain"] = sum(
            plain_alone[str(i)] == spec_alone[str(i)] for i in range(n)
        )
        log(label, "greedy spec == plain", same, "of", n, differing)
    linear_module.ROW_INVARIANT_ON_CUDA = True
    RESULTS["engine"] = result


# --------------------------------------------------------------------------- bisect
BISECT_CONFIGS = {  # engine arguments; "_triton": every float product on the Triton GEMM
    "default": {},
    "eager (no graphs)": {"enforce_eager": True},
    "no async": {"async_scheduling": False},
    "no prefill graphs": {"prefill_graph_tokens": 0},
    "triton everywhere": {"_triton": True},
    "eager, no async, triton": {"enforce_eager": True, "async_scheduling": False, "_triton": True},
}


def force_triton(on: bool) -> None:
    """Every float product on the Triton GEMM (the start-up cuBLAS check skipped) or back."""
    from specdec.engine import setup as setup_module
    from specdec.models import linear as linear_module

    if not hasattr(setup_module, "_probe_check"):
        setup_module._probe_check = setup_module.check_cublas_rows
    linear_module._CUBLAS_ROWS.clear()
    setup_module.check_cublas_rows = (lambda w, m: {}) if on else setup_module._probe_check


def part_bisect(model_path: str | None, which: str = "random,builtin") -> None:
    """The replay fixtures' six requests (tests/replay_fixtures.py) alone against a closed batch
    and uniform arrivals, tokens (the overlapped path) and with logprobs (values bit for bit),
    under each of BISECT_CONFIGS: which part of the CUDA path makes a row depend on its batch."""
    from bench_gpu_engine import build_ours
    from replay_fixtures import (
        arrivals,
        drive,
        mismatches,
        replay_requests,
        run_alone,
        with_logprobs,
    )
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm_engine import LLMEngine

    models = {"random": build_ours(SHAPE, DEVICE)} if "random" in which else {}
    if model_path and "builtin" in which:
        models["builtin"] = model_path
    requests = replay_requests()
    result = {}
    for model_name, model in models.items():
        for config_name, args in BISECT_CONFIGS.items():
            args = dict(args)
            force_triton(args.pop("_triton", False))
            path = model if isinstance(model, str) else None

            def make():
                config = EngineConfig(
                    model=path,
                    device=DEVICE,
                    dtype="bfloat16",
                    max_model_len=128,
                    num_kv_blocks=512,
                    **args,
                )
                built = None if path else model
                return LLMEngine(config, SpeculativeConfig.from_dict(None), model=built)

            row = {}
            t0 = time.perf_counter()
            for values in (False, True):
                batch = with_logprobs(requests) if values else requests
                alone = run_alone(make(), batch)  # one engine, idle between requests
                # Each request alone on a fresh engine (a fresh, zeroed cache; default settings
                # only): differs from the reused engine only if a step reads cache slots outside
                # its context.
                if config_name == "default":
                    fresh = [drive(make(), [request], [(0, 0)])[0] for request in batch]
                    row["fresh" + (" values" if values else " tokens")] = mismatches(
                        alone, fresh, batch
                    )
                for pattern in ("closed", "uniform"):
                    got = drive(make(), batch, arrivals(pattern, len(batch)).schedule)
                    key = pattern + (" values" if values else " tokens")
                    row[key] = mismatches(alone, got, batch)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            if config_name == "default":  # the weights' layout and the cuBLAS check's verdicts
                from specdec.models import linear as linear_module

                engine = make()
                row["weights"] = sorted(
                    {
                        (tuple(w.shape), w.is_contiguous(), tuple(w.stride()), w.data_ptr() % 256)
                        for w in engine.model.float_product_weights()
                    }
                )
                row["cublas rows"] = {str(k[:2]): v for k, v in linear_module._CUBLAS_ROWS.items()}
                del engine
            result[f"{model_name} / {config_name}"] = row
            log(
                model_name,
                config_name,
                {k: len(v) if isinstance(v, list) else v for k, v in row.items()},
            )
            torch.cuda.empty_cache()
    force_triton(False)
    RESULTS["bisect"] = result


def graphed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) captured in a CUDA graph (after a warm-up on a side stream) and
    replayed once."""
    import torch.nn.functional as F

    out = torch.empty(x.shape[0], weight.shape[0], device="cuda", dtype=weight.dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(F.linear(x, weight))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(F.linear(x, weight))
    graph.replay()
    torch.cuda.synchronize()
    return out


def part_capture(families: str = "smollm2") -> None:
    """cuBLAS inside a captured graph against eager: each weight shape of `families`
    (WEIGHT_SHAPES keys), rows alone (eager, and each replayed from a one-row graph) against the
    same rows of an M-row product, eager and replayed from a graph, M = 1..64."""
    import torch.nn.functional as F

    result = {}
    shapes = [shape for family in families.split(",") for shape in WEIGHT_SHAPES[family]]
    for n, k in shapes:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(64)])
        graph_alone = torch.cat([graphed_linear(x[i : i + 1], weight) for i in range(64)])
        eager_bad, graph_bad, graph_vs_graph_bad = [], [], []
        for m in range(1, 65):
            if not torch.equal(F.linear(x[:m], weight), alone[:m]):
                eager_bad.append(m)
            out = graphed_linear(x[:m], weight)
            if not torch.equal(out, alone[:m]):
                graph_bad.append(m)
            if not torch.equal(out, graph_alone[:m]):
                graph_vs_graph_bad.append(m)
        result[f"{n}x{k}"] = {
            "eager differs at M": eager_bad,
            "graph differs at M": graph_bad,
            "graph differs from one-row graphs at M": graph_vs_graph_bad,
            "one-row graph == eager alone": bool(torch.equal(graph_alone, alone)),
        }
        log(n, k, result[f"{n}x{k}"])
    RESULTS["capture"] = result


# --------------------------------------------------------------------------- tpot
def part_tpot() -> None:
    from bench_gpu_engine import build_ours, engine_tpot, make_llm, random_prompts
    from specdec.models import linear as linear_module

    model = build_ours("smollm2-135m")
    result = {}
    for _repeat in range(2):
        for row_invariant in (True, False):
            linear_module.ROW_INVARIANT_ON_CUDA = row_invariant
            for batch in (1, 64):
                llm = make_llm(model, None, max_num_seqs=64)
                prompts = random_prompts(batch, 49152, seed=batch)
                res = engine_tpot(llm, prompts, 64)
                key = f"{'row-invariant' if row_invariant else 'cuBLAS'} b{batch}"
                result.setdefault(key, []).append(res["tpot_ms"])
                log(key, round(res["tpot_ms"], 4), "ms")
                del llm
                torch.cuda.empty_cache()
    linear_module.ROW_INVARIANT_ON_CUDA = True
    RESULTS["tpot_ms"] = {k: statistics.median(v) for k, v in result.items()}
    RESULTS["tpot_ms_runs"] = result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="dot,attention,engine,tpot")
    parser.add_argument("--toggle-linear", action="store_true")
    parser.add_argument("--model", default=None, help="engine part: a GGUF or HF path")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU")
    parser.add_argument("--bisect-models", default="random,builtin", help="bisect: which models")
    parser.add_argument(
        "--capture-families",
        default="smollm2",
        help="capture: WEIGHT_SHAPES families, comma-separated (smollm2, llama-3-8b, tiny)",
    )
    args = parser.parse_args()
    if args.smoke:
        global DEVICE, SHAPE
        import bench_gpu_engine

        DEVICE, SHAPE = "cpu", "tiny"
        bench_gpu_engine.SHAPES["tiny"] = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "vocab_size": 500,
        }
    RESULTS["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    RESULTS["torch"] = torch.__version__
    parts = args.parts.split(",")
    for part in parts:
        t0 = time.perf_counter()
        try:
            if part == "dot":
                part_dot()
            elif part == "attention":
                part_attention()
            elif part == "engine":
                part_engine(args.toggle_linear, args.model)
            elif part == "tpot":
                part_tpot()
            elif part == "prefill-tiles":
                part_prefill_tiles()
            elif part == "tune":
                part_tune()
            elif part == "bisect":
                part_bisect(args.model, args.bisect_models)
            elif part == "capture":
                part_capture(args.capture_families)
        except Exception as error:  # keep the other parts' results
            import traceback

            traceback.print_exc()
            RESULTS[f"{part}_error"] = repr(error)
        log(f"part {part}: {time.perf_counter() - t0:.1f} s")
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
