"""Where `sample()`'s GPU time goes: its chunk kernel with parts switched off or replaced.

    python benchmarks/probes/sample_variants.py --out variants.json [--batch 256] [--vocab 151936]
        [--dtype bfloat16] [--plans-only]

Times (median of `triton.testing.do_bench`, L2 flushed) a copy of `_sample_chunk_kernel` with
knobs: DIV (0 IEEE division `div_rn`, 1 multiplication by the reciprocal (not exact, timing only),
2 division by the correctly rounded reciprocal plus one FMA correction (Markstein)), NOISE (0
none, 1 the shipped keyed Gumbel noise, 2 Philox words only, 3 -log(-log(u)) with two fast logs
(not accurate, timing only)), LSE (the log-normaliser accumulators on / off), STORE (writing the
processed logits on / off), over tile plans. Also counts, over 2**27 random (x, T) pairs on the
device, how often DIV=2 differs from `div_rn`. Diagnostic only: nothing here is used by specdec.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.language as tl

from specdec.rng.philox_triton import (
    fast_log,
    gumbel_tile,
    keyed_words_tile,
    words_to_uniform32,
)
from specdec.sampling.sampler_triton import (
    argmax_finish,
    argmax_update,
    lse_finish,
    lse_update,
    tile_lanes,
)


@triton.jit
def _divide(x, divisor, recip, DIV: tl.constexpr):
    if DIV == 0:
        out = tl.math.div_rn(x, divisor)
    elif DIV == 1:
        out = x * recip
    else:
        q0 = x * recip
        err = tl.math.fma(-q0, divisor, x)
        out = tl.math.fma(err, recip, q0)
    return out


@triton.jit
def _variant_kernel(
    logits_ptr,
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    processed_ptr,
    chunk_ptr,
    vocab,
    num_chunks,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,
    DIV: tl.constexpr,
    NOISE: tl.constexpr,
    LSE: tl.constexpr,
    STORE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    divisor = tl.where(temperature > 0.0, temperature, 1.0)
    recip = tl.math.div_rn(1.0, divisor)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    chunk_first = chunk * TILES * (4 * ROWS)
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = chunk_first + 4 * tl.arange(0, ROWS)
    for t in tl.static_range(TILES):
        first_lane = chunk_first + t * (4 * ROWS)
        lanes = tile_lanes(first_lane, ROWS)
        x = tl.load(logits_ptr + row * vocab + lanes, mask=lanes < vocab, other=float("-inf"))
        x = _divide(x.to(tl.float32), divisor, recip, DIV)
        if STORE:
            tl.store(processed_ptr + row * vocab + lanes, x, mask=lanes < vocab)
        if LSE:
            run_max, run_sum = lse_update(run_max, run_sum, x)
        if NOISE == 1:
            val = x + gumbel_tile(seed, position, 0, 0, first_lane // 4, ROWS)
        elif NOISE == 2:
            words = keyed_words_tile(seed, position, 0, 0, first_lane // 4, ROWS)
            val = x + words_to_uniform32(words)
        elif NOISE == 3:
            words = keyed_words_tile(seed, position, 0, 0, first_lane // 4, ROWS)
            val = x - fast_log(-fast_log(words_to_uniform32(words)))
        else:
            val = x
        best, best_idx = argmax_update(best, best_idx, val, lanes)
    chunk_max, chunk_sum = lse_finish(run_max, run_sum)
    top, top_idx = argmax_finish(best, best_idx)
    out = (row * num_chunks + chunk) * 4
    tl.store(chunk_ptr + out, chunk_max)
    tl.store(chunk_ptr + out + 1, chunk_sum)
    tl.store(chunk_ptr + out + 2, top)
    tl.store(chunk_ptr + out + 3, top_idx.to(tl.float32))


@triton.jit
def _division_mismatch_kernel(x_ptr, t_ptr, count_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=1.0)
    t = tl.load(t_ptr + offsets, mask=mask, other=1.0)
    recip = tl.math.div_rn(1.0, t)
    exact = tl.math.div_rn(x, t)
    fast = _divide(x, t, recip, 2)
    same = (exact == fast) | ((exact != exact) & (fast != fast))
    tl.atomic_add(count_ptr, tl.sum((~same & mask).to(tl.int32)))


def division_mismatches(num: int, device: torch.device) -> dict[str, int]:
    """Pairs (x, T) where the Markstein quotient differs from div_rn: logits of several
    magnitudes (normal, huge, tiny, subnormal, zero, infinities) against temperatures in
    [0.05, 4] and over all normal float32 values."""
    gen = torch.Generator(device=device).manual_seed(0)
    results = {}
    cases = {
        "x~N(0,10^2), T in [0.05, 4]": (
            10 * torch.randn(num, generator=gen, device=device),
            0.05 + 3.95 * torch.rand(num, generator=gen, device=device),
        ),
        "x random bits (finite), T in [0.05, 4]": (
            torch.randint(0, 2**31, (num,), generator=gen, device=device, dtype=torch.int32)
            .view(torch.float32)
            .nan_to_num(0.0, 0.0, 0.0),
            0.05 + 3.95 * torch.rand(num, generator=gen, device=device),
        ),
        "x~N(0,1), T random normal float32 > 0": (
            torch.randn(num, generator=gen, device=device),
            torch.randint(2**23, 0x7F000000, (num,), generator=gen, device=device)
            .to(torch.int32)
            .view(torch.float32),
        ),
    }
    for name, (x, t) in cases.items():
        count = torch.zeros(1, dtype=torch.int32, device=device)
        _division_mismatch_kernel[(triton.cdiv(num, 1024),)](x, t, count, num, BLOCK=1024)
        results[name] = int(count.item())
    return results


def _runner(grid, meta, logits, tensors):
    """A call of one variant, rotating over the logits copies (more than 2x L2 together)."""
    state = itertools.count()
    temperature, seeds, positions, processed, chunk = tensors
    vocab = logits[0].shape[1]

    def run():
        _variant_kernel[grid](
            logits[next(state) % len(logits)],
            temperature,
            seeds,
            positions,
            processed,
            chunk,
            vocab,
            grid[1],
            **meta,
        )

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--plans-only",
        action="store_true",
        help="only the tile plans of the shipped kernel's knobs (no knob sets, no division count)",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    batch, vocab = args.batch, args.vocab
    gen = torch.Generator(device=device).manual_seed(1)
    copies = 4
    dtype = getattr(torch, args.dtype)
    logits = [
        torch.randn(batch, vocab, generator=gen, device=device).to(dtype) for _ in range(copies)
    ]
    temperature = torch.full((batch,), 0.7, device=device)
    seeds = torch.arange(batch, device=device, dtype=torch.int64) * 7919
    positions = torch.arange(batch, device=device, dtype=torch.int64) + 100
    processed = torch.empty(batch, vocab, device=device)
    floor_bytes = batch * vocab * (logits[0].element_size() + 4)  # read logits, write fp32
    results = {"batch": batch, "vocab": vocab, "dtype": args.dtype, "variants": []}
    start = time.time()
    plans = [(2, 4, 4), (1, 4, 4), (4, 4, 4), (2, 8, 4), (2, 4, 8), (2, 4, 2), (1, 8, 8)]
    knob_sets = [(0, 1, 1, 1), (2, 1, 1, 1), (1, 1, 1, 1), (0, 0, 1, 1), (0, 2, 1, 1)]
    knob_sets += [(0, 3, 1, 1), (0, 1, 0, 1), (0, 1, 1, 0), (0, 0, 0, 1), (2, 3, 1, 1)]
    configs = [(p, k) for p in plans[:1] for k in knob_sets]
    configs += [(p, (0, 1, 1, 1)) for p in plans[1:]] + [(p, (2, 1, 1, 1)) for p in plans[1:]]
    if args.plans_only:  # the shipped kernel's knobs (IEEE division, its noise, lse, store)
        plans = [(1, 4, 4), (2, 4, 4), (1, 4, 8), (1, 4, 2), (2, 4, 2), (1, 8, 4), (1, 2, 4)]
        plans += [(2, 2, 4), (1, 2, 8), (4, 2, 2), (1, 8, 2)]
        configs = [(p, (0, 1, 1, 1)) for p in plans]
    for (rows_per_thread, warps, tiles), (div, noise, lse, store) in configs:
        rows = 32 * warps * rows_per_thread
        num_chunks = triton.cdiv(vocab, 4 * rows * tiles)
        chunk = torch.empty(batch, num_chunks, 4, device=device)
        grid = (batch, num_chunks)
        meta = {"ROWS": rows, "TILES": tiles, "DIV": div, "NOISE": noise, "LSE": lse}
        meta |= {"STORE": store, "num_warps": warps}
        run = _runner(grid, meta, logits, (temperature, seeds, positions, processed, chunk))
        run()
        ms = triton.testing.do_bench(run, warmup=25, rep=200)
        entry = {
            "rows_per_thread": rows_per_thread,
            "num_warps": warps,
            "tiles": tiles,
            "div": div,
            "noise": noise,
            "lse": lse,
            "store": store,
            "ms": ms,
            "x_floor": ms / (floor_bytes / 4.28e12 * 1e3),
        }
        print(entry, flush=True)
        results["variants"].append(entry)
    if not args.plans_only:
        results["division_mismatches_of_2**27"] = division_mismatches(2**27, device)
        print(results["division_mismatches_of_2**27"], flush=True)
    results["seconds"] = time.time() - start
    with open(args.out, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
