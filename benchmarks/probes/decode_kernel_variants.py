"""Launch plans of the decode step's own kernels, and a Triton GEMM beside cuBLAS for the thin
(M <= 64) matrix products of a decode step: a diagnostic, not a benchmark.

    python benchmarks/probes/decode_kernel_variants.py --out variants.json

(1) `_paged_decode_attention_kernel` under several (BLOCK_N, num_warps, num_stages) at the
Llama-3-8B and Llama-3.2-1B head shapes, batch 1 and 64, 1 and 5 query tokens per sequence,
contexts 192 and 1024; each output compared with the shipped plan's. (2) A plain Triton GEMM
y = x W^T (no split-K: every output element is one fixed-order sum, so results replay) under
several tile plans, beside `F.linear`, on the 8B and 1B weight shapes at M = 1, 8, 64. Times are
medians of `triton.testing.do_bench` (L2 flushed between calls). Nothing here is used by specdec.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from specdec.models.attention import DecodeMetadata
from specdec.models.fused_triton import _paged_decode_attention_kernel

ATTENTION_SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # H_q, H_kv, D
ATTENTION_PLANS = [(64, 4, 1), (64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 2, 2), (128, 4, 2)]
ATTENTION_PLANS += [(128, 8, 2), (64, 8, 2), (16, 2, 2), (32, 4, 3), (128, 8, 3)]


def attention_case(heads, batch: int, q: int, context: int, block: int = 16) -> dict:
    num_heads, num_kv, dim = heads
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks, block, num_kv, dim, device="cuda", generator=gen)
    v_cache = torch.randn(num_blocks, block, num_kv, dim, device="cuda", generator=gen)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen)
    tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int64)
    query = torch.randn(batch * q, num_heads, dim, device="cuda", generator=gen).bfloat16()
    meta = DecodeMetadata(
        block_tables=tables,
        context_lens=torch.full((batch,), context, dtype=torch.int64, device="cuda"),
        query_lens=torch.full((batch,), q, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.zeros(batch * q, dtype=torch.int64, device="cuda"),
        query_per_seq=q,
    )
    group = num_heads // num_kv

    def launch(block_n, warps, stages):
        out = torch.empty_like(query)
        _paged_decode_attention_kernel[(batch, num_kv)](
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_lens,
            out,
            meta.block_tables.stride(0),
            dim**-0.5,
            Q_PER_SEQ=q,
            GROUP=group,
            NUM_KV_HEADS=num_kv,
            HEAD_DIM=dim,
            CACHE_BLOCK=block,
            BLOCK_M=max(16, triton.next_power_of_2(q * group)),
            BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            IEEE=False,
            DEVICE_BOUND=True,
            HOST_NUM_CHUNKS=0,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    reference = launch(64, 4, 3)  # the shipped plan (Triton's default num_stages is 3)
    kv_bytes = 2 * batch * context * num_kv * dim * 2
    rows = {}
    for plan in ATTENTION_PLANS:
        out = launch(*plan)
        ms = do_bench(lambda p=plan: launch(*p), warmup=20, rep=100, return_mode="median")
        rows[str(plan)] = {
            "ms": round(ms, 5),
            "kv_tb_per_s": round(kv_bytes / ms / 1e9, 2),
            "max_abs_diff_vs_shipped": float((out.float() - reference.float()).abs().max()),
        }
    return rows


@triton.jit
def _thin_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    y_ptr,  # [M, N]
    M,
    N,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(
            x_ptr + rows[:, None] * K + (k + ks)[None, :], mask=rows[:, None] < M, other=0.0
        )
        w = tl.load(
            w_ptr + cols[:, None] * K + (k + ks)[None, :], mask=cols[:, None] < N, other=0.0
        )
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(
        y_ptr + rows[:, None] * N + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def thin_gemm(x, w, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _thin_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        y,
        m,
        n,
        k,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y


GEMM_SHAPES = {
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
    "1b qkv": (3072, 2048),
    "1b o": (2048, 2048),
    "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192),
}
GEMM_PLANS = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 6)]
GEMM_PLANS += [(16, 256, 4, 4), (32, 128, 4, 6), (128, 64, 4, 4), (64, 128, 8, 4)]


def gemm_case(n: int, k: int, m: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    floor_ms = w.numel() * 2 / 4.28e9
    reference = F.linear(x, w)
    rows = {"cublas": {"ms": do_bench(lambda: F.linear(x, w), rep=100, return_mode="median")}}
    for plan in GEMM_PLANS:
        try:
            out = thin_gemm(x, w, *plan)
            ms = do_bench(lambda p=plan: thin_gemm(x, w, *p), rep=100, return_mode="median")
        except Exception as error:  # a plan that does not fit the shared memory
            rows[str(plan)] = {"error": str(error)[:120]}
            continue
        rows[str(plan)] = {
            "ms": ms,
            "max_abs_diff_vs_cublas": float((out.float() - reference.float()).abs().max()),
        }
    for row in rows.values():
        if "ms" in row:
            row["of_floor"] = round(floor_ms / row["ms"], 3)
            row["ms"] = round(row["ms"], 5)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="attention,gemm")
    args = parser.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%F %T")}
    if "attention" in args.parts:
        for name, heads in ATTENTION_SHAPES.items():
            for batch in (1, 64):
                for q in (1, 5):
                    for context in (192, 1024):
                        key = f"attention {name} b{batch} q{q} ctx{context}"
                        report[key] = attention_case(heads, batch, q, context)
                        best = min(report[key].items(), key=lambda kv: kv[1]["ms"])
                        shipped = report[key][str((64, 4, 3))]["ms"]
                        print(key, "best", best, "shipped", shipped, flush=True)
    if "gemm" in args.parts:
        for name, (n, k) in GEMM_SHAPES.items():
            for m in (1, 8, 64):
                key = f"gemm {name} [{n}x{k}] M={m}"
                report[key] = rows = gemm_case(n, k, m)
                best = min(
                    ((p, r) for p, r in rows.items() if "ms" in r), key=lambda kv: kv[1]["ms"]
                )
                print(key, "cublas", rows["cublas"], "best", best, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
