"""Long-context attention kernels on the GPU, Llama-3-8B attention shape (32 query heads, 8 KV
heads, head dim 128, bfloat16, 16-token cache blocks scattered at random):

- prefill: a 32K and a 128K prompt in 8K chunks over the paged cache through the flash-style
  kernel, as achieved TFLOP/s (causal FLOPs: 4 * H_q * D * L^2 / 2) against the bf16 tensor-core
  throughput of a plain 8192^3 matrix product measured in the same run, and against
  `scaled_dot_product_attention` (flash backend, contiguous K/V expanded to 32 heads, the whole
  prompt causal) beside it; the old eager path (masked SDPA over gathered K/V) at 32K;
- decode at 128K context, batch 1: the split-KV kernels and the single-pass kernel, bf16 and FP8
  caches, per layer, against the floor (K/V bytes read / the copy bandwidth measured in the same
  run);
- verify: 5 query tokens at 128K against 1.

    PYTHONPATH=src:tests python3 benchmarks/bench_long_attention.py --out DIR \
        [--prefill-lens 32768,131072] [--chunk 8192] [--decode-len 131072] [--old-prefill-max 32768]

Targets (issue 18): prefill >= 60% of the matmul throughput; decode attention near the KV-read
floor (the TPOT target adds the weights: see the engine benchmarks); verify <= 1.15x decode.
About a minute on an H200. Writes DIR/long_attention.json (machine, date, command, rows). Never
imported by tests.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_engine import cuda_ms, log  # the benchmarks' one CUDA-event timer

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def randn(*shape, seed: int, dtype=DTYPE) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)


def matmul_tflops() -> float:
    n = 8192
    a, b = randn(n, n, seed=1), randn(n, n, seed=2)
    ms = cuda_ms(lambda: torch.mm(a, b), 20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_bandwidth_gbs() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def paged_cache(context_len: int, seed: int, dtype=DTYPE):
    """K/V caches holding `context_len` tokens in scattered blocks, and the block table."""
    num_blocks = -(-context_len // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = randn(*shape, seed=seed), randn(*shape, seed=seed + 1)
    if dtype != DTYPE:
        from specdec.models.attention import to_cache_dtype

        k_cache, v_cache = to_cache_dtype(k_cache, dtype), to_cache_dtype(v_cache, dtype)
    generator = torch.Generator().manual_seed(seed + 2)
    table = torch.randperm(num_blocks, generator=generator).to("cuda")
    return k_cache, v_cache, table[None]


def causal_flops(length: int) -> float:
    return 4 * NUM_HEADS * HEAD_DIM * length * length / 2


def _row(part: str, length: int, kernel: str, ms: float, peak: float, **extra) -> dict:
    tflops = causal_flops(length) / (ms * 1e-3) / 1e12
    row = {"part": part, "length": length, "kernel": kernel, "ms": ms, "tflops": tflops}
    row.update(fraction_of_matmul=tflops / peak, **extra)
    log(row)
    return row


def prefill_one(length: int, chunk: int, with_old: bool, peak: float) -> list[dict]:
    """A `length`-token prompt in `chunk`-token chunks: ours, SDPA flash, the old path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specdec.models import attention
    from specdec.models.attention import AttentionMetadata, paged_attention
    from specdec.models.prefill_attention import paged_prefill_attention

    scale = HEAD_DIM**-0.5
    k_cache, v_cache, table = paged_cache(length, seed=10)
    query = randn(chunk, NUM_HEADS, HEAD_DIM, seed=11)
    # Chunk i: its queries are the last `size` tokens of a context of start + size tokens.
    chunks = []
    for start in range(0, length, chunk):
        size = min(chunk, length - start)
        cu = torch.tensor([0, size], device="cuda")
        chunks.append((size, cu, torch.tensor([start + size], device="cuda")))

    def flash() -> None:
        for size, cu, context in chunks:
            paged_prefill_attention(
                query[:size], k_cache, v_cache, cu, context, table, size, scale=scale
            )

    rows = [_row("prefill", length, "flash paged (ours)", cuda_ms(flash, 2), peak, chunk=chunk)]
    # SDPA, flash backend, contiguous K/V expanded to all query heads, the whole prompt at once.
    full_q = randn(1, NUM_HEADS, length, HEAD_DIM, seed=12)
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = (
        cache[table[0]].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(group, dim=0)
        for cache in (k_cache, v_cache)
    )  # [H_q, L, D]
    keys, values = keys[None].contiguous(), values[None].contiguous()

    def sdpa() -> None:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(full_q, keys, values, is_causal=True, scale=scale)

    sdpa_name = "torch sdpa flash (contiguous, whole prompt)"
    rows.append(_row("prefill", length, sdpa_name, cuda_ms(sdpa, 2), peak))
    if with_old:  # the old eager path: masked SDPA over gathered K/V
        blocks = table[0].tolist()

        def old() -> None:
            for size, _, context in chunks:
                end = int(context[0])
                meta = AttentionMetadata.build([size], [end], [blocks], BLOCK_SIZE, "cuda")
                paged_attention(query[:size], k_cache, v_cache, meta, scale=scale)

        attention.FLASH_PREFILL_ON_CUDA = False
        try:
            old_ms = cuda_ms(old, 1)
        finally:
            attention.FLASH_PREFILL_ON_CUDA = True
        old_name = "old eager path (masked sdpa, gathered K/V)"
        rows.append(_row("prefill", length, old_name, old_ms, peak, chunk=chunk))
    return rows


def decode_one(length: int, cache_dtype: torch.dtype, name: str, copy_gbs: float) -> list[dict]:
    """Batch 1 at `length` keys, 1 and 5 query tokens, split-KV and single-pass, per layer."""
    from specdec.models import fused, split_kv
    from specdec.models.attention import DecodeMetadata

    scale = HEAD_DIM**-0.5
    k_cache, v_cache, table = paged_cache(length, seed=20, dtype=cache_dtype)
    kv_bytes = 2 * length * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    floor_ms = kv_bytes / (copy_gbs * 1e9) * 1e3
    rows, times = [], {}
    for q_per_seq in (1, 5):
        query = randn(q_per_seq, NUM_HEADS, HEAD_DIM, seed=21)
        for kernel, parts in (("split-KV", split_kv.num_partitions(length)), ("single-pass", 0)):
            meta = DecodeMetadata(
                block_tables=table,
                context_lens=torch.tensor([length], device="cuda"),
                query_lens=torch.tensor([q_per_seq], device="cuda"),
                slot_mapping=torch.full((q_per_seq,), -1, device="cuda"),
                query_per_seq=q_per_seq,
                num_partitions=parts,
            )

            def attend(query=query, meta=meta) -> None:
                fused.paged_decode_attention(query, k_cache, v_cache, meta, scale)

            ms = cuda_ms(attend, 20 if parts else 3)
            times[(kernel, q_per_seq)] = ms
            row = {
                "part": "decode" if q_per_seq == 1 else "verify",
                "context": length,
                "query_tokens": q_per_seq,
                "kv_cache": name,
                "kernel": kernel,
                "ms_per_layer": ms,
                "kv_read_floor_ms": floor_ms,
                "ratio_to_floor": ms / floor_ms,
                "kv_bytes_per_layer": kv_bytes,
            }
            if q_per_seq == 5:
                row["ratio_to_decode"] = ms / times[(kernel, 1)]
            rows.append(row)
            log(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--prefill-lens", default="32768,131072")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--decode-len", type=int, default=131072)
    parser.add_argument("--old-prefill-max", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_long_attention.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    peak = matmul_tflops()
    copy_gbs = copy_bandwidth_gbs()
    log(f"bf16 matmul {peak:.0f} TFLOP/s, copy {copy_gbs:.0f} GB/s (read + write)")
    lengths = [int(n) for n in args.prefill_lens.split(",") if n]
    rows = []
    for length in lengths:
        rows += prefill_one(length, args.chunk, length <= args.old_prefill_max, peak)
        torch.cuda.empty_cache()
    for cache_dtype, name in ((DTYPE, "bf16"), (torch.float8_e4m3fn, "fp8")):
        rows += decode_one(args.decode_len, cache_dtype, name, copy_gbs)
        torch.cuda.empty_cache()
    result = {
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "matmul_bf16_tflops": peak,
        "copy_bandwidth_gbs": copy_gbs,
        "rows": rows,
        "seconds": time.time() - started,
    }
    path = args.out / "long_attention.json"
    path.write_text(json.dumps(result, indent=2))
    log(f"wrote {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
