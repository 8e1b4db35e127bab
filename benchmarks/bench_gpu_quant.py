"""Quantized weights on the GPU: the engine's decode TPOT with bf16, FP8 (e4m3, per channel),
int8 (per channel) and int4 (group-wise) weights on a Llama-3-8B-shaped model (random weights),
at batch 1 and 64, the per-matrix kernel time against cuBLAS bf16, and gpt-fast's int8/int4
weight-only modes beside us in the same process.

    python benchmarks/bench_gpu_quant.py --out DIR [--shape llama-3-8b] [--batches 1,64] \
        [--formats bf16,fp8,int4,int8] [--gpt-fast-dir PATH [--gpt-fast-modes int8,int4]] \
        [--gpt-fast-batches 1] [--new-tokens 64]

Targets (issue 15): batch-1 TPOT with FP8 <= 0.6x bf16, int4 <= 0.4x; batch 64 with FP8
<= 0.65x. gpt-fast (github.com/pytorch-labs/gpt-fast, not part of this repository) is run when
--gpt-fast-dir points at a checkout (model.py, generate.py, quantize.py). Writes DIR/quant.json
(machine, date, command, rows). Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_engine as base


def log(*args) -> None:
    print(*args, flush=True)


def build(shape: str, fmt: str):
    from specdec.models import quantize_model

    model = base.build_ours(shape)
    if fmt != "bf16":
        quantize_model(model, fmt)
        torch.cuda.empty_cache()
    return model


def gemm_rows(model, fmt: str, batches: list[int]) -> dict:
    """Milliseconds of each weight kind's product at M = batch, and the bf16 cuBLAS time of the
    same shape (random bf16 weight), cycling through every layer's weights."""
    from specdec.models.quant import quant_linear

    layers = model.model.layers
    kinds = {
        "qkv": [layer.self_attn.qkv_proj for layer in layers],
        "o": [layer.self_attn.o_proj for layer in layers],
        "gate_up": [layer.mlp.gate_up_proj for layer in layers],
        "down": [layer.mlp.down_proj for layer in layers],
    }
    rows = {}
    for kind, linears in kinds.items():
        quantized = [linear.quantized for linear in linears]
        n, k = quantized[0].shape
        for batch in batches:
            x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
            ours = base.cuda_ms(lambda x=x, q=quantized: [quant_linear(x, w) for w in q], 5) / len(
                quantized
            )
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            cublas = base.cuda_ms(
                lambda x=x, d=dense, q=quantized: [torch.nn.functional.linear(x, d) for _ in q], 5
            ) / len(quantized)
            floor_ms = quantized[0].nbytes / 4.8e9  # H200: 4.8 TB/s
            rows[f"{kind} M={batch}"] = {
                "ms": ours,
                "bf16_cublas_ms": cublas,
                "ratio": ours / cublas,
                "weight_read_floor_ms": floor_ms,
                "shape": [n, k],
            }
            del dense
    return rows


def bench_ours(shape: str, formats: list[str], batches: list[int], new_tokens: int) -> dict:
    results = {}
    for fmt in formats:
        model = build(shape, fmt)
        log(f"[ours] {shape} {fmt}: built ({torch.cuda.memory_allocated() / 2**30:.1f} GiB)")
        llm = base.make_llm(model, async_scheduling=False)
        for batch in batches:
            prompts = base.random_prompts(batch, base.COMMON["vocab_size"], seed=batch)
            row = base.engine_tpot(llm, prompts, new_tokens)
            results[f"{fmt} b{batch}"] = row
            log(f"[ours] {fmt} b{batch}: TPOT {row['tpot_ms']:.3f} ms")
        if fmt != "bf16":
            results[f"{fmt} gemm"] = gemm_rows(model, fmt, batches)
        del llm, model
        torch.cuda.empty_cache()
    for fmt in formats:
        for batch in batches:
            bf16 = results.get(f"bf16 b{batch}")
            if bf16 and fmt != "bf16":
                results[f"{fmt} b{batch}"]["tpot_vs_bf16"] = (
                    results[f"{fmt} b{batch}"]["tpot_ms"] / bf16["tpot_ms"]
                )
    return results


def bench_gpt_fast(
    shape: str, batches: list[int], new_tokens: int, gpt_fast_dir: str, modes: list[str]
) -> dict:
    """gpt-fast's decode step (torch.compile, reduce-overhead) in `modes` (bf16, int8, int4 with
    group size 128: its weight-only modes) on the same shape."""
    sys.path.insert(0, gpt_fast_dir)
    import generate as gf_generate  # gpt-fast's generate.py
    import quantize as gf_quantize  # gpt-fast's quantize.py
    from model import ModelArgs, Transformer  # gpt-fast's model.py

    cfg = base.SHAPES[shape]
    args = ModelArgs(
        block_size=8192,
        vocab_size=base.COMMON["vocab_size"],
        n_layer=cfg["num_hidden_layers"],
        n_head=cfg["num_attention_heads"],
        n_local_heads=cfg["num_key_value_heads"],
        dim=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        rope_base=base.COMMON["rope_theta"],
    )
    results: dict = {}
    for mode in modes:
        try:
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = Transformer(args).to(torch.bfloat16).eval()
            if mode == "int8":
                handler = gf_quantize.WeightOnlyInt8QuantHandler(model)
                state = handler.create_quantized_state_dict()
                model = handler.convert_for_runtime()
                model.load_state_dict(state, assign=True)
            elif mode == "int4":
                handler = gf_quantize.WeightOnlyInt4QuantHandler(model, groupsize=128)
                state = handler.create_quantized_state_dict()
                model = handler.convert_for_runtime()
                model.load_state_dict(state, assign=True)
            model = model.cuda()
            decode = torch.compile(
                gf_generate.decode_one_token, mode="reduce-overhead", fullgraph=True
            )
            for batch in batches:
                with torch.device("cuda"):
                    model.setup_caches(max_batch_size=batch, max_seq_length=512)
                prompt = torch.tensor(
                    base.random_prompts(batch, base.COMMON["vocab_size"], seed=batch)
                ).cuda()
                input_pos = torch.arange(base.PROMPT_LEN, device="cuda")
                with torch.no_grad():
                    token = gf_generate.prefill(model, prompt, input_pos)
                pos = torch.tensor([base.PROMPT_LEN], device="cuda")

                def step(token=token, pos=pos, model=model, batch=batch, decode=decode):
                    with torch.no_grad():
                        return decode(model, token.view(batch, 1), pos)

                start = time.perf_counter()
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                ms = base.cuda_ms(step, new_tokens)
                results[f"{mode} b{batch}"] = {"ms_per_step": ms, "compile_s": compile_s}
                log(f"[gpt-fast] {mode} b{batch}: {ms:.3f} ms/step")
            del model
        except Exception as err:  # a mode gpt-fast cannot run here is reported, not fatal
            results[mode] = {"error": f"{type(err).__name__}: {err}"}
            log(f"[gpt-fast] {mode}: {err}")
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--formats", default="bf16,fp8,int4,int8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gpt-fast-dir", default=None)
    parser.add_argument("--gpt-fast-modes", default="int8,int4", help="of bf16,int8,int4")
    parser.add_argument("--gpt-fast-batches", default=None, help="default: --batches")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = {"ours": bench_ours(args.shape, args.formats.split(","), batches, args.new_tokens)}
    if args.gpt_fast_dir:
        gf_batches = [int(b) for b in (args.gpt_fast_batches or args.batches).split(",")]
        results["gpt_fast"] = bench_gpt_fast(
            args.shape,
            gf_batches,
            args.new_tokens,
            args.gpt_fast_dir,
            args.gpt_fast_modes.split(","),
        )
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": args.shape,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.json").write_text(json.dumps({"meta": meta, **results}, indent=2))
    log(f"{'run':<14} {'TPOT ms':>9} {'vs bf16':>8}")
    for name, row in results["ours"].items():
        if "tpot_ms" in row:
            ratio = row.get("tpot_vs_bf16")
            shown = "-" if ratio is None else f"{ratio:.3f}"
            log(f"{name:<14} {row['tpot_ms']:>9.3f} {shown:>8}")


if __name__ == "__main__":
    main()
