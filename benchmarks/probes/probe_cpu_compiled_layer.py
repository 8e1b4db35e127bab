"""Probe (issue 38): what `torch.compile` (inductor, CPU) buys the CPU decode step's per-layer
work, and whether it keeps the rows' bits. On the built-in SmolLM2 GGUF (kept quantized), the
part of a decoder layer after attention (o_proj, residual add + RMSNorm, gate/up product, SiLU *
up, down product: `LlamaAttention.o_proj` .. `LlamaMLP.forward_decode`) run three ways:

- eager: the engine's own calls (what a decode step runs today);
- compiled: the same function through `torch.compile(fullgraph=True, dynamic=False)`, once per
  row count, the int4 products staying PyTorch's kernel (an extern call in inductor's code);
- compiled with inductor's C++ wrapper (`cpp_wrapper=True`: no Python between its kernels).

Per variant: microseconds a call at 1 / 2 / 4 rows (median of --repeats, --iters calls each), and
bits: compiled against eager at each row count, and row 0 of a 4-row call against the 1-row call
(row invariance, which replay and greedy speculation == greedy plain rely on).

    python benchmarks/probes/probe_cpu_compiled_layer.py [--threads 2] [--iters 300] > FILE.txt

Time it with nothing else running (or, on a busy machine, `--threads 1 --cpu-time`: CPU time of
one thread, a rough proxy). Never imported by tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.models.decoder_layers import add_norm


def layer_tail(layer, attn_out: torch.Tensor, residual: torch.Tensor):
    """o_proj, then the MLP half of the layer: ([T, H*D], [T, D]) -> (out, residual)."""
    out = layer.self_attn.o_proj.decode(attn_out)
    normed, residual = add_norm(out, residual, layer.post_attention_layernorm)
    return layer.mlp.forward_decode(normed), residual


CLOCK = time.perf_counter


def time_calls(fn, args, iters: int, repeats: int) -> float:
    for _ in range(20):
        fn(*args)
    samples = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(iters):
            fn(*args)
        samples.append((CLOCK() - start) / iters)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU clock (with --threads 1: a proxy on a busy machine)",
    )
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    from specdec.engine.llm import LLM

    llm = LLM(speculative_config=None)
    model = llm.engine.model
    layer = model.model.layers[0]
    width = layer.self_attn.num_heads * layer.self_attn.head_dim
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    most = max(rows)
    attn = torch.randn(most, width, generator=generator)
    resid = torch.randn(most, hidden, generator=generator)
    inputs = {m: (attn[:m].clone(), resid[:m].clone()) for m in rows}  # row 0 shared

    def eager(a, r):
        return layer_tail(layer, a, r)

    variants = {"eager": eager}
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    variants["compiled"] = compiled
    results = {}
    with torch.inference_mode():
        reference = {m: eager(*inputs[m]) for m in rows}
        for name, fn in variants.items():
            start = time.perf_counter()
            outs = {m: fn(*inputs[m]) for m in rows}
            first = time.perf_counter() - start
            line = [f"{name:10s} first calls {first:6.2f} s"]
            for m in rows:
                us = time_calls(fn, inputs[m], args.iters, args.repeats)
                same = all(torch.equal(x, y) for x, y in zip(outs[m], reference[m], strict=True))
                line.append(f"M={m}: {us:7.1f} us, equal to eager {same}")
            m = max(rows)
            invariant = (
                all(torch.equal(x[:1], y) for x, y in zip(outs[m], outs[1], strict=True))
                if 1 in rows
                else None
            )
            line.append(f"row 0 of M={m} == M=1: {invariant}")
            results[name] = line
            print(" | ".join(line), flush=True)
        inductor_config.cpp_wrapper = True
        torch._dynamo.reset()
        wrapped = torch.compile(eager, fullgraph=True, dynamic=False)
        try:
            start = time.perf_counter()
            outs = {m: wrapped(*inputs[m]) for m in rows}
            first = time.perf_counter() - start
            line = [f"{'cpp_wrap':10s} first calls {first:6.2f} s"]
            for m in rows:
                us = time_calls(wrapped, inputs[m], args.iters, args.repeats)
                same = all(torch.equal(x, y) for x, y in zip(outs[m], reference[m], strict=True))
                line.append(f"M={m}: {us:7.1f} us, equal to eager {same}")
            print(" | ".join(line), flush=True)
        except Exception as err:  # a probe: report and go on
            print(f"cpp_wrapper failed: {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
