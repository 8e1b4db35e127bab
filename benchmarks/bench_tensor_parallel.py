"""Tensor-parallel benchmark: the target's decode step (TPOT) of Llama-3-8B-shaped models at TP = 1
and TP = 2 (batch 1 and 64), the all-reduce cost inside it, the driver's per-step broadcast of
the step inputs, and a Llama-3-70B-shaped model (does not fit one GPU) at TP = 2 against its
weight-read floor (each GPU reads its shard once per step). Random bf16 weights made on each
GPU (no files); each rank builds only its shard, as `load_model(shard=...)` would read it.

    PYTHONPATH=src:tests python3 benchmarks/bench_tensor_parallel.py --out DIR \
        [--parts step,engine] [--batches 1,64] [--steps 50] [--hbm-tbps 4.8] \
        [--checkpoint DIR_8B]  # for the engine part: benchmarks/make_checkpoint.py llama-3-8b

Parts:
- step: per (shape, TP, batch), ranks spawned here run `PagedModelRunner.run_rows` (the graphed
  decode path, all-reduces captured) over a context of PROMPT_LEN tokens; CUDA-event ms per
  step on rank 0 (every rank runs the same graph); the all-reduces alone (2 per layer, of
  [B, hidden] bf16) replayed in one CUDA graph; the gloo broadcast of a step's StepInputs.
- engine: LLM(checkpoint, tensor_parallel_size=1 / 2) TPOT through the whole engine
  ((t(1 + n) - t(1)) / n), when --checkpoint is given.

Writes DIR/tensor_parallel.json. `--device cpu --shapes tiny` runs the same code on the CPU at toy
sizes (a smoke check; its times mean nothing). Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPT_LEN = 128
BLOCK_SIZE = 16
SHAPES = {
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "llama-3-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "tiny": {  # the CPU smoke check
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "vocab_size": 97,
    },
}
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# (shape, TP) runs of the step part: 70B only at TP = 2 (its bf16 weights, 141 GB, fit no GPU).
RUNS = (("llama-3-8b", 1), ("llama-3-8b", 2), ("llama-3-70b", 2))


def log(*args) -> None:
    print(*args, flush=True)


def build_shard(shape: str, rank: int, world_size: int, device: torch.device):
    """Rank `rank`'s shard of a random-weight model (None layout at TP = 1), collectives on."""
    from specdec.models import LlamaForCausalLM, ModelConfig
    from specdec.models.tensor_parallel import Collectives, shard_layout
    from specdec.models.weights import assign_weights

    config = ModelConfig.from_hf_config({**COMMON, **SHAPES[shape]})
    layout = shard_layout(config, rank, world_size) if world_size > 1 else None
    with torch.device("meta"):
        model = LlamaForCausalLM(config, layout)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(rank)

    def read(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=dtype, device=device)
        out = torch.empty(shapes[name], dtype=dtype, device=device)
        return out.normal_(0.0, 0.02, generator=generator)

    assign_weights(model, read, f"random:{shape}", dtype, device)
    if layout is not None:
        model.attach_collectives(Collectives(layout))
    return model


def timed_ms(fn, iters: int, device: torch.device) -> float:
    """Mean ms per call of `fn` (CUDA events on the GPU, the wall clock on the CPU)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def step_rank(rank: int, world_size: int, port: int, args: dict, queue) -> None:
    """One rank of the step part for one (shape, TP): every batch, rank 0 reports."""
    from specdec.runner.model_runner import PagedModelRunner, StepInput

    torch.set_num_threads(1 if args["device"] == "cpu" else 4)
    device = torch.device("cuda", rank) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    control = dist.new_group(backend="gloo")
    shape, batches, steps = args["shape"], args["batches"], args["steps"]
    model = build_shard(shape, rank, world_size, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    max_batch = max(batches)
    blocks_per_seq = -(-(PROMPT_LEN + steps * 3 + 8) // BLOCK_SIZE)
    runner = PagedModelRunner(
        model,
        num_blocks=max_batch * blocks_per_seq,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_batch,
        max_model_len=blocks_per_seq * BLOCK_SIZE,
        decode_path=True,
    )
    result: dict = {"shape": shape, "tp": world_size, "weight_bytes_per_rank": weight_bytes}
    hidden = model.config.hidden_size
    for batch in batches:
        inputs = [
            StepInput(
                token_ids=[3 + b],
                start=PROMPT_LEN,
                block_ids=list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)),
                num_logit_rows=1,
            )
            for b in range(batch)
        ]
        dist.barrier()
        step_ms = timed_ms(lambda inputs=inputs: runner.run_rows(inputs), steps, device)
        entry = {"batch": batch, "step_ms": step_ms}
        if world_size > 1:
            partial = torch.zeros(batch, hidden, dtype=model.dtype, device=device)
            num_reduces = 2 * model.config.num_hidden_layers

            def reduces(partial=partial, num_reduces=num_reduces) -> None:
                for _ in range(num_reduces):
                    dist.all_reduce(partial)

            dist.barrier()
            entry["all_reduce_eager_ms_per_step"] = timed_ms(reduces, steps, device)
            if device.type == "cuda":
                reduces()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    reduces()
                dist.barrier()
                entry["all_reduce_graphed_ms_per_step"] = timed_ms(graph.replay, steps, device)
            # The driver's broadcast of a step's inputs (host, gloo): the part the engine adds.
            message = [("run_rows_with_features", (inputs, (), False, {}))]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                dist.broadcast_object_list(list(message), src=0, group=control)
            entry["control_broadcast_ms"] = (time.perf_counter() - start) / steps * 1e3
        if rank == 0:
            log(json.dumps(entry))
        result.setdefault("batches", []).append(entry)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def bench_steps(args: argparse.Namespace) -> list[dict]:
    context = mp.get_context("spawn")
    runs = RUNS if args.shapes is None else [(s, tp) for s in args.shapes for tp in (1, 2)]
    results = []
    for shape, tp in runs:
        if args.device == "cuda" and tp > torch.cuda.device_count():
            log(f"skip {shape} TP={tp}: {torch.cuda.device_count()} GPUs")
            continue
        log(f"step: {shape} TP={tp}")
        queue = context.Queue()
        from specdec.runner.tensor_parallel import free_local_port

        port = free_local_port()
        spec = {"shape": shape, "batches": args.batches, "steps": args.steps, "device": args.device}
        ranks = [
            context.Process(target=step_rank, args=(rank, tp, port, spec, queue))
            for rank in range(tp)
        ]
        for process in ranks:
            process.start()
        result = queue.get(timeout=1800)
        for process in ranks:
            process.join(120)
        floor_ms = result["weight_bytes_per_rank"] / (args.hbm_tbps * 1e12) * 1e3
        result["weight_read_floor_ms"] = floor_ms
        for entry in result["batches"]:
            entry["vs_floor"] = entry["step_ms"] / floor_ms
        results.append(result)
    by_key = {(r["shape"], r["tp"]): r for r in results}
    for shape in {r["shape"] for r in results}:
        one, two = by_key.get((shape, 1)), by_key.get((shape, 2))
        if one and two:
            two["tp2_over_tp1"] = {
                e2["batch"]: e2["step_ms"] / e1["step_ms"]
                for e1, e2 in zip(one["batches"], two["batches"], strict=True)
            }
    return results


def bench_engine(args: argparse.Namespace) -> list[dict]:
    """TPOT through LLM(tensor_parallel_size=1 / 2) on a checkpoint directory."""
    from specdec import LLM, SamplingParams

    results = []
    for tp in (1, 2):
        llm = LLM(
            args.checkpoint,
            tensor_parallel_size=tp,
            dtype="bfloat16" if args.device == "cuda" else "float32",
            device=args.device,
            speculative_config=None,
            max_num_seqs=max(args.batches),
            max_model_len=1024,
            num_kv_blocks=max(args.batches) * 1024 // BLOCK_SIZE + 64,
        )
        vocab = llm.engine.model_config.vocab_size
        generator = torch.Generator().manual_seed(0)
        for batch in args.batches:
            prompts = torch.randint(3, vocab, (batch, PROMPT_LEN), generator=generator).tolist()

            def run(max_tokens: int, prompts=prompts, llm=llm) -> float:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - start

            run(1 + args.steps)  # warm-up: graphs for this batch
            prefill_s = statistics.median(run(1) for _ in range(3))
            total_s = statistics.median(run(1 + args.steps) for _ in range(3))
            entry = {"tp": tp, "batch": batch, "tpot_ms": (total_s - prefill_s) / args.steps * 1e3}
            log(json.dumps(entry))
            results.append(entry)
        llm.close()
        del llm
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="step")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM TB/s (H200: 4.8)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", default=None, help="comma list (default: 8B at TP 1 / 2, 70B)")
    parser.add_argument("--checkpoint", default=None, help="HF directory for the engine part")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.shapes = None if args.shapes is None else args.shapes.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "num_gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "torch": torch.__version__,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "command": " ".join(sys.argv),
    }
    parts = args.parts.split(",")
    if "step" in parts:
        report["step"] = bench_steps(args)
    if "engine" in parts:
        if args.checkpoint is None:
            parser.error("--parts engine needs --checkpoint (benchmarks/make_checkpoint.py)")
        report["engine"] = bench_engine(args)
    (out / "tensor_parallel.json").write_text(json.dumps(report, indent=2))
    log(f"wrote {out / 'tensor_parallel.json'}")


if __name__ == "__main__":
    main()
