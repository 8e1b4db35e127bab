"""Probe: weight-only and FP8 matrix products on the GPU for the Llama-3-8B projection shapes,
to choose the kernels behind `quantization="fp8"` / `"int4"` on CUDA (issue 15).

For M in --rows: bf16 `F.linear` (cuBLAS); the FP8 Triton kernel of `quant_triton.py` under
several tile plans; `torch._scaled_mm` with FP8 activations quantized per row (W8A8, cuBLASLt);
PyTorch's int4 weight-only kernel (`_weight_int4pack_mm`, tinygemm, as gpt-fast uses) at group
sizes 32 and 128. Every figure is the replay time of a CUDA graph of 24 products cycling over
copies of the weight (more bytes than L2 holds), divided by 24. Each variant also records
whether a row's result is the same alone (M = 1) as inside the M = 64 product.

    python benchmarks/probes/probe_quant_kernels.py --out DIR [--rows 1,8,64]

Writes DIR/quant_kernels.json. Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
PLANS = [  # BLOCK_M, BLOCK_N, BLOCK_K, dot, warps, stages
    (16, 64, 128, True, 4, 2),
    (16, 32, 256, True, 4, 3),
    (16, 32, 512, True, 4, 3),
    (16, 16, 512, True, 4, 4),
    (16, 64, 256, True, 8, 3),
    (16, 128, 128, True, 8, 3),
    (16, 32, 256, True, 4, 5),
    (64, 64, 128, True, 4, 3),
    (64, 128, 128, True, 8, 3),
    (32, 32, 256, True, 4, 3),
    (64, 32, 256, True, 4, 3),
    (64, 64, 256, True, 8, 3),
]
SAME_ORDER = ((16, 32, 256, True, 4, 3), (32, 32, 256, True, 4, 3), (64, 32, 256, True, 4, 3))


def log(*args) -> None:
    print(*args, flush=True)


def graph_ms(fns, repeats: int = 3) -> float:
    """Milliseconds per call of the callables in `fns` replayed in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / (5 * len(fns)))
    return best


def copies_for(nbytes: int) -> int:
    return max(2, min(24, (256 << 20) // max(nbytes, 1) + 1))


def fp8_weight(n: int, k: int):
    from specdec.models.quant import QuantizedWeight
    from specdec.models.quant_formats import quantize_fp8

    dense = torch.randn(n, k, device="cuda") * 0.02
    return QuantizedWeight(quantize_fp8(dense), torch.device("cuda"))


def probe_shape(name: str, n: int, k: int, rows: list[int]) -> dict:
    from specdec.models import quant_triton

    out: dict = {"shape": [n, k]}
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in [*rows, 64]}
    # bf16 cuBLAS
    count = copies_for(n * k * 2)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    for m in rows:
        x = xs[m]
        fns = [lambda w=w, x=x: F.linear(x, w) for w in weights] * (24 // count + 1)
        out[f"bf16_m{m}"] = graph_ms(fns[:24])
    x64 = xs[64]
    out["bf16_invariant"] = bool(
        torch.equal(F.linear(x64[:1], weights[0])[0], F.linear(x64, weights[0])[0])
    )
    del weights
    torch.cuda.empty_cache()
    # FP8 Triton plans
    count = copies_for(n * k)
    fp8s = [fp8_weight(n, k) for _ in range(count)]
    for plan in PLANS:
        tag = "x".join(str(int(v)) for v in plan)
        try:
            for m in rows:
                x = xs[m]
                fns = [
                    lambda w=w, x=x, plan=plan: quant_triton.quant_matmul_triton(
                        x, w._tensors, w._meta, w.shape, plan
                    )
                    for w in fp8s
                ] * (24 // count + 1)
                out[f"fp8_triton_{tag}_m{m}"] = graph_ms(fns[:24])
            w = fp8s[0]
            alone = quant_triton.quant_matmul_triton(x64[:1], w._tensors, w._meta, w.shape, plan)
            batch = quant_triton.quant_matmul_triton(x64, w._tensors, w._meta, w.shape, plan)
            want = (x64.float() @ w.dequantize().to(torch.bfloat16).float().t()).to(torch.bfloat16)
            out[f"fp8_triton_{tag}_invariant"] = bool(torch.equal(alone[0], batch[0]))
            out[f"fp8_triton_{tag}_maxdiff"] = float((batch.float() - want.float()).abs().max())
        except Exception as error:  # a plan that does not compile is a result
            out[f"fp8_triton_{tag}_error"] = repr(error)[:300]
    # Plans of one BLOCK_N and BLOCK_K: does BLOCK_M change a row's result?
    w = fp8s[0]
    results = [
        quant_triton.quant_matmul_triton(x64, w._tensors, w._meta, w.shape, plan)
        for plan in SAME_ORDER
    ]
    out["fp8_triton_block_m_invariant"] = [bool(torch.equal(results[0], r)) for r in results]
    # FP8 W8A8 through cuBLASLt, activations quantized per row
    try:
        wq = [w._tensors["values"] for w in fp8s]
        sb = [w._tensors["scale"].view(1, n).float() for w in fp8s]

        def scaled(x, w, s):
            amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
            sa = amax / 448.0
            xq = (x.float() / sa).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=s, out_dtype=torch.bfloat16)

        for m in rows:
            x = xs[m] if m % 16 == 0 else F.pad(xs[m], (0, 0, 0, 16 - m % 16))
            fns = [lambda w=w, s=s, x=x: scaled(x, w, s) for w, s in zip(wq, sb, strict=True)]
            fns = (fns * (24 // count + 1))[:24]
            out[f"fp8_scaled_mm_m{m}"] = graph_ms(fns)
        pad = F.pad(x64[:1], (0, 0, 0, 15))
        out["fp8_scaled_mm_invariant"] = bool(
            torch.equal(scaled(pad, wq[0], sb[0])[0], scaled(x64, wq[0], sb[0])[0])
        )
    except Exception as error:
        out["fp8_scaled_mm_error"] = repr(error)[:300]
    del fp8s
    torch.cuda.empty_cache()
    # int4 tinygemm
    for group in (32, 128):
        try:
            count = copies_for(n * k // 2)
            packs = []
            for _ in range(count):
                nib = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
                packed = ((nib[:, ::2] << 4) | nib[:, 1::2]).to(torch.uint8)
                packed = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
                sz = torch.randn(k // group, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
                packs.append((packed, sz))
            for m in rows:
                x = xs[m]
                fns = [
                    lambda p=p, s=s, x=x, g=group: torch.ops.aten._weight_int4pack_mm(x, p, g, s)
                    for p, s in packs
                ]
                out[f"int4_tinygemm_g{group}_m{m}"] = graph_ms((fns * (24 // count + 1))[:24])
            p, s = packs[0]
            out[f"int4_tinygemm_g{group}_invariant"] = bool(
                torch.equal(
                    torch.ops.aten._weight_int4pack_mm(x64[:1], p, group, s)[0],
                    torch.ops.aten._weight_int4pack_mm(x64, p, group, s)[0],
                )
            )
            del packs
            torch.cuda.empty_cache()
        except Exception as error:
            out[f"int4_tinygemm_g{group}_error"] = repr(error)[:300]
    log(name, json.dumps(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    result = {
        "machine": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": {},
    }
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        result["shapes"][name] = probe_shape(name, n, k, rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "quant_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
