"""Benchmark of `sample()` and `verify()` on the GPU against the copy bandwidth, a plain PyTorch
chain verifier and FlashInfer's pipeline, measured side by side in one run.

    python benchmarks/bench_sampling.py --out results.json [--sweep] [--no-flashinfer]

Times are medians of `triton.testing.do_bench` (which flushes L2 before every call); inputs rotate
over enough copies to exceed twice the L2. Bytes are those the kernels actually move (each live
logit read once per pass that reads it, processed logits written); bandwidth is compared with a
large fp32 `copy_` measured in the same run. Inputs come from the project's keyed RNG, so every
run sees the same logits. Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
import triton
import triton.testing

from specdec.rng import Stream
from specdec.rng.philox_triton import uniform_triton
from specdec.sampling import sample, sampler_triton
from specdec.verify import check_verify_inputs, verifier_triton, verify
from specdec.verify.verifier_triton import verify_triton

K = 4
TEMPERATURE = 0.7
L2_BYTES = 60 * 2**20
ELEMENT_SIZE = {torch.float32: 4, torch.bfloat16: 2}


def bench(fn: Callable[[], object], rep_ms: int = 120) -> float:
    """Median milliseconds of fn() (do_bench: events, L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def back_to_back(fn: Callable[[], object], calls: int = 200) -> float:
    """Milliseconds per call of `calls` calls in a row (wall clock, no L2 flush between them):
    the rate a caller issuing one call after another gets, host work included."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large fp32 device-to-device copy_."""
    numel = 2**29  # 2 GiB
    src = torch.ones(numel, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda src=src, dst=dst: dst.copy_(src))
    return 2 * numel * 4 / (ms * 1e-3)


def normal_logits(rows: int, vocab: int, stream: int, scale: float) -> torch.Tensor:
    """[rows, vocab] float32 N(0, scale^2) logits from keyed uniforms (inverse normal CDF)."""
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") + 7 * stream
    positions = torch.arange(rows, dtype=torch.int64, device="cuda") * 3 + stream
    u = uniform_triton(seeds, positions, Stream.TARGET, vocab, step=stream)
    return scale * torch.special.ndtri(u)


def make_round(batch: int, vocab: int, dtype: torch.dtype, method: str, copy_index: int):
    """One verification round: target logits, drafts sampled by `sample()` from a draft that
    is the target plus noise (accepts often, rejects often), and the keys."""
    seeds = torch.arange(batch, dtype=torch.int64, device="cuda") * 1_000_003 + copy_index
    anchors = torch.arange(batch, dtype=torch.int64, device="cuda") * 17 + 100
    target = normal_logits(batch * (K + 1), vocab, 3 * copy_index, 2.0).view(batch, K + 1, vocab)
    noise = normal_logits(batch * K, vocab, 3 * copy_index + 1, 1.0).view(batch, K, vocab)
    draft_raw = target[:, :K] + noise
    coupled = method == "coupled"
    out = sample(
        draft_raw.reshape(batch * K, vocab),
        seeds.repeat_interleave(K),
        (anchors[:, None] + torch.arange(K, device="cuda")).flatten(),
        temperature=TEMPERATURE,
        stream=Stream.TARGET if coupled else Stream.DRAFT,
        step=0 if coupled else anchors.repeat_interleave(K),
    )
    return {
        "target": target.to(dtype),
        "drafts": out.token_ids.view(batch, K),
        "draft_logits": out.processed_logits.view(batch, K, vocab),
        "draft_lse": out.logsumexp.view(batch, K),
        "seeds": seeds,
        "anchors": anchors,
    }


def num_copies(bytes_per_copy: int) -> int:
    return max(1, min(32, math.ceil(2 * L2_BYTES / bytes_per_copy)))


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def verify_bytes(round_: dict, result, method: str, lse_given: bool) -> int:
    """Bytes the verifier's passes read (all requests sampled, num_draft = K): target rows
    0..K-1 and their draft rows (normalisers; skipped with lse given), then per request the
    residual row pair at a rejection or the bonus row; block adds a mass pass over rows 1..K-1.
    Coupled reads every target row once."""
    batch, rows, vocab = round_["target"].shape
    t_size = round_["target"].element_size()
    d_size = 4
    if method == "coupled":
        return batch * rows * vocab * t_size
    total = batch * K * vocab * t_size
    if not lse_given:
        total += batch * K * vocab * d_size
    rejected = int((result.num_accepted < K).sum())
    total += rejected * vocab * (t_size + d_size) + (batch - rejected) * vocab * t_size
    if method == "block" and K > 1:
        total += batch * (K - 1) * vocab * (t_size + d_size)
    return total


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn() (its launches replayed without Python overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def launch_overhead_us() -> dict:
    """Host microseconds per launch: a Triton kernel of ~10 arguments that exits at once, and a
    one-element torch fill, each launched 500 times back to back."""
    from specdec.verify.verifier_kernels import _verify_emit_kernel

    final_row = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    best = torch.zeros(1, 16, device="cuda")
    idx = torch.zeros(1, 16, dtype=torch.int32, device="cuda")
    tokens = torch.zeros(1, K + 1, dtype=torch.int64, device="cuda")

    def emit() -> None:
        _verify_emit_kernel[(1,)](
            final_row, best, idx, best, idx, tokens, 16, 1, K=K, CHUNKS=16, num_warps=1
        )

    def fill() -> None:
        torch.zeros(1, device="cuda")

    out = {}
    for name, fn in (("triton_launch", emit), ("torch_zeros", fill)):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - start) / 500 * 1e6
    print(json.dumps({"launch_overhead_us": out}), flush=True)
    return out


def torch_chain(round_: dict, uniforms: torch.Tensor, noise: torch.Tensor):
    """Plain PyTorch token-level chain verification: two softmaxes, gathers, the full-vocabulary
    residual of every row, Gumbel-max on the chosen row (noise precomputed)."""
    target_probs = torch.softmax(round_["target"].float() / TEMPERATURE, dim=-1)
    draft_probs = torch.softmax(round_["draft_logits"], dim=-1)
    drafts = round_["drafts"]
    t_at = target_probs[:, :K].gather(-1, drafts[..., None]).squeeze(-1)
    d_at = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accept = uniforms * d_at < t_at
    accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    residual = (target_probs[:, :K] - draft_probs).clamp_min(0)
    residual = torch.cat([residual, target_probs[:, K:]], dim=1)
    row = residual.gather(1, accepted[:, None, None].expand(-1, 1, residual.shape[-1])).squeeze(1)
    final = (row.log() + noise).argmax(dim=-1)
    return accepted, final


def flashinfer_pipeline(flashinfer, round_: dict):
    batch, rows, vocab = round_["target"].shape
    target_probs = flashinfer.sampling.softmax(
        round_["target"].view(batch * rows, vocab), temperature=TEMPERATURE
    )
    draft_probs = flashinfer.sampling.softmax(round_["draft_logits"].view(batch * K, vocab))
    return flashinfer.sampling.chain_speculative_sampling(
        draft_probs.view(batch, K, vocab),
        round_["drafts"].to(torch.int32),
        target_probs.view(batch, rows, vocab),
        seed=1234,
        offset=0,
    )


def run_shape(
    batch: int, vocab: int, dtype: torch.dtype, copy_bw: float, flashinfer, sample_only=False
) -> list:
    results = []
    elt = ELEMENT_SIZE[dtype]

    def record(op: str, ms: float, nbytes: int | None, **extra) -> None:
        row = {"op": op, "B": batch, "K": K, "V": vocab, "dtype": str(dtype).split(".")[-1]}
        row.update(extra)
        row["ms"] = ms
        row["bytes"] = nbytes
        row["GBps"] = nbytes / (ms * 1e-3) / 1e9 if nbytes else None
        row["frac_copy_bw"] = nbytes / (ms * 1e-3) / copy_bw if nbytes else None
        row["floor_ms"] = nbytes / copy_bw * 1e3 if nbytes else None
        results.append(row)
        print(json.dumps(row), flush=True)

    # sample(): N = B rows, all sampled.
    sample_bytes = batch * vocab * (elt + 4)
    copies = num_copies(sample_bytes)
    logits = [normal_logits(batch, vocab, 50 + c, 2.0).to(dtype) for c in range(copies)]
    seeds = torch.arange(batch, dtype=torch.int64, device="cuda")
    positions = seeds + 1000
    fns = [lambda x=x: sample(x, seeds, positions, temperature=TEMPERATURE) for x in logits]
    record("sample", bench(rotating(fns)), sample_bytes)
    record("sample_back_to_back", back_to_back(rotating(fns)), sample_bytes)
    unchecked = [
        lambda x=x: sample(x, seeds, positions, temperature=TEMPERATURE, check_values=False)
        for x in logits
    ]
    record("sample_unchecked", bench(rotating(unchecked)), sample_bytes)
    del logits, fns, unchecked

    if sample_only:
        return results
    round_bytes = batch * vocab * ((K + 1) * elt + K * 4)
    copies = num_copies(round_bytes)
    for method in ("standard", "block", "coupled"):
        rounds = [make_round(batch, vocab, dtype, method, c) for c in range(copies)]
        lse_options = (False, True) if method != "coupled" else (False,)
        for lse_given in lse_options:

            def call(r: dict, lse_given: bool = lse_given, method: str = method):
                return verify(
                    r["target"],
                    r["drafts"],
                    r["draft_logits"],
                    r["seeds"],
                    r["anchors"],
                    temperature=TEMPERATURE,
                    method=method,
                    draft_logsumexp=r["draft_lse"] if lse_given else None,
                )

            result = call(rounds[0])
            nbytes = verify_bytes(rounds[0], result, method, lse_given)
            accepted = float(result.num_accepted.float().mean())
            ms = bench(rotating([lambda r=r: call(r) for r in rounds]))
            record("verify", ms, nbytes, method=method, lse=lse_given, mean_accepted=accepted)
            ms = back_to_back(rotating([lambda r=r: call(r) for r in rounds]))
            record("verify_back_to_back", ms, nbytes, method=method, lse=lse_given)
            inputs = [
                check_verify_inputs(
                    r["target"],
                    r["drafts"],
                    r["draft_logits"],
                    r["seeds"],
                    r["anchors"],
                    temperature=TEMPERATURE,
                    method=method,
                    draft_logsumexp=r["draft_lse"] if lse_given else None,
                )
                for r in rounds
            ]
            ms = bench(rotating([lambda i=i: verify_triton(i) for i in inputs]))
            record("verify_triton", ms, nbytes, method=method, lse=lse_given)
            graphs = [capture(lambda i=i: verify_triton(i)) for i in inputs]
            ms = bench(rotating([g.replay for g in graphs]))
            record("verify_graph", ms, nbytes, method=method, lse=lse_given)
            if method == "standard" and not lse_given:
                validate = [
                    lambda r=r: check_verify_inputs(
                        r["target"],
                        r["drafts"],
                        r["draft_logits"],
                        r["seeds"],
                        r["anchors"],
                        temperature=TEMPERATURE,
                    )
                    for r in rounds
                ]
                record("validate", bench(rotating(validate)), None, method=method)
            del inputs, graphs
        if method == "standard":
            uniforms = torch.full((batch, K), 0.5, device="cuda")
            noise = normal_logits(batch, vocab, 99, 1.0)
            chain = [lambda r=r, u=uniforms, g=noise: torch_chain(r, u, g) for r in rounds]
            ms = bench(rotating(chain))
            record("torch_chain", ms, None, method="standard")
            if flashinfer is not None:
                try:
                    ms = bench(
                        rotating([lambda r=r: flashinfer_pipeline(flashinfer, r) for r in rounds])
                    )
                    record("flashinfer", ms, None, method="standard")
                except Exception as exc:  # report and keep going
                    print(f"flashinfer failed at B={batch} V={vocab}: {exc!r}", flush=True)
        del rounds
    torch.cuda.empty_cache()
    return results


def sweep(copy_bw: float) -> list:
    """Times the headline shapes under several tile plans (rows per thread, warps, tiles)."""
    results = []
    plans = [(2, 4, 4), (4, 4, 2), (2, 8, 2), (1, 4, 8)]
    batch, vocab = 256, 151936
    round_ = make_round(batch, vocab, torch.float32, "standard", 0)
    logits = normal_logits(batch, vocab, 50, 2.0)
    seeds = torch.arange(batch, dtype=torch.int64, device="cuda")
    saved = dict(sampler_triton.STREAM_PLAN), dict(verifier_triton.FINAL_PLAN)
    for rows_per_thread, num_warps, tiles in plans:
        plan = {"rows_per_thread": rows_per_thread, "num_warps": num_warps, "tiles": tiles}
        sampler_triton.STREAM_PLAN.update(plan)
        verifier_triton.FINAL_PLAN.update(plan)
        inputs = check_verify_inputs(
            round_["target"],
            round_["drafts"],
            round_["draft_logits"],
            round_["seeds"],
            round_["anchors"],
            temperature=TEMPERATURE,
        )
        verify_ms = bench(lambda inputs=inputs: verify_triton(inputs))
        sample_ms = bench(lambda: sample(logits, seeds, seeds, temperature=TEMPERATURE))
        row = {"plan": plan, "verify_triton_ms": verify_ms, "sample_ms": sample_ms}
        results.append(row)
        print(json.dumps(row), flush=True)
    sampler_triton.STREAM_PLAN.update(saved[0])
    verifier_triton.FINAL_PLAN.update(saved[1])
    return results


def load_flashinfer():
    try:
        import flashinfer
        import flashinfer.sampling
    except Exception as exc:
        print(f"flashinfer unavailable: {exc!r}", flush=True)
        return None
    start = time.time()
    try:
        batch, vocab = 2, 1000
        probs = torch.softmax(torch.zeros(batch, K + 1, vocab, device="cuda"), dim=-1)
        flashinfer.sampling.chain_speculative_sampling(
            probs[:, :K].contiguous(),
            torch.zeros(batch, K, dtype=torch.int32, device="cuda"),
            probs,
            seed=1,
            offset=0,
        )
        torch.cuda.synchronize()
    except Exception as exc:
        print(f"flashinfer chain_speculative_sampling failed: {exc!r}", flush=True)
        return None
    print(f"flashinfer {flashinfer.__version__} ready (first call {time.time() - start:.0f} s)")
    return flashinfer


def print_table(results: list, copy_bw: float) -> None:
    print(f"\ncopy bandwidth (fp32 copy_, read+write): {copy_bw / 1e12:.2f} TB/s")
    header = f"{'op':<14}{'method':<9}{'lse':<4}{'B':>4}{'V':>8}{'dtype':>9}{'ms':>9}"
    print(header + f"{'floor ms':>9}{'GB/s':>8}{'%copy':>7}{'vs FI':>7}{'vs torch':>9}")
    baseline = {}
    for r in results:
        if r["op"] in ("flashinfer", "torch_chain"):
            baseline[(r["op"], r["B"], r["V"], r["dtype"])] = r["ms"]
    for r in results:
        key = (r["B"], r["V"], r["dtype"])
        fi = baseline.get(("flashinfer", *key))
        pt = baseline.get(("torch_chain", *key))
        is_std_verify = r["op"].startswith("verify") and r.get("method") == "standard"
        vs_fi = f"{fi / r['ms']:.2f}x" if fi and is_std_verify else ""
        vs_pt = f"{pt / r['ms']:.2f}x" if pt and is_std_verify else ""
        lse = {True: "y", False: "n"}.get(r.get("lse"), "")
        floor = f"{r['floor_ms']:.3f}" if r["floor_ms"] else ""
        gbps = f"{r['GBps']:.0f}" if r["GBps"] else ""
        frac = f"{100 * r['frac_copy_bw']:.0f}" if r["frac_copy_bw"] else ""
        print(
            f"{r['op']:<14}{r.get('method', ''):<9}{lse:<4}{r['B']:>4}{r['V']:>8}{r['dtype']:>9}"
            f"{r['ms']:>9.3f}{floor:>9}{gbps:>8}{frac:>7}{vs_fi:>7}{vs_pt:>9}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--sweep", action="store_true", help="only sweep tile plans")
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--sample-only", action="store_true", help="time sample() only")
    parser.add_argument("--batches", default="256,64,1")
    parser.add_argument("--vocabs", default="151936,32000")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"{device}: copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    report = {"device": device, "copy_bandwidth_Bps": copy_bw, "K": K, "temperature": TEMPERATURE}
    report["launch_overhead_us"] = launch_overhead_us()
    if args.sweep:
        report["sweep"] = sweep(copy_bw)
    else:
        flashinfer = None if args.no_flashinfer else load_flashinfer()
        report["flashinfer"] = getattr(flashinfer, "__version__", None)
        results = report["results"] = []
        for vocab in map(int, args.vocabs.split(",")):
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                for batch in map(int, args.batches.split(",")):
                    results += run_shape(batch, vocab, dtype, copy_bw, flashinfer, args.sample_only)
                    with open(args.out, "w") as f:  # after every shape: a timeout keeps them
                        json.dump(report, f, indent=1)
        print_table(results, copy_bw)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
