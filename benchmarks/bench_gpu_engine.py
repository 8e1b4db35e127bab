"""GPU engine benchmark: plain decoding of Llama-3.2-1B- and Llama-3-8B-shaped models (random bf16
weights made on the GPU) in specdec, beside HF `transformers` generate (dynamic and static cache)
and gpt-fast on the same shapes, in one run; the cost of a verify forward (K + 1 = 5 tokens per
request) against a 1-token decode step; speculative vs plain decoding in the engine.

    python benchmarks/bench_gpu_engine.py --out DIR [--parts ours,gptfast,hf] \
        [--shapes llama-3.2-1b,llama-3-8b] [--batches 1,8,64] [--gpt-fast-dir PATH]

gpt-fast is not part of this repository: fetch it (github.com/pytorch-labs/gpt-fast) and point
--gpt-fast-dir at its checkout (model.py, generate.py, tokenizer.py). Each part writes
DIR/<part>.json; the tables in BENCHMARKS.md are read from those. Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPT_LEN = 128
SHAPES = {
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    # SmolLM2-135M-Instruct's shape (probes only: the engine benchmark runs the two above).
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
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


def hf_config(shape: str) -> dict:
    return {**COMMON, **SHAPES[shape]}


def log(*args) -> None:
    print(*args, flush=True)


def cuda_ms(fn, iters: int) -> float:
    """Mean milliseconds per call of fn over `iters` calls, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def random_prompts(batch: int, vocab: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


# --------------------------------------------------------------------------- specdec
def build_ours(shape: str, device: str = "cuda"):
    from specdec.models import LlamaForCausalLM, ModelConfig
    from specdec.models.weights import assign_weights

    config = ModelConfig.from_hf_config(hf_config(shape))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    generator = torch.Generator(device=device).manual_seed(0)

    def read(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=torch.bfloat16, device=device)
        out = torch.empty(shapes[name], dtype=torch.bfloat16, device=device)
        return out.normal_(0.0, 0.02, generator=generator)

    assign_weights(model, read, f"random:{shape}", torch.bfloat16, device)
    return model


def make_llm(model, spec=None, max_num_seqs=64, max_model_len=None, **kwargs):
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm import LLM
    from specdec.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device=model.model.embed_tokens.weight.device.type,
        dtype="bfloat16",
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len or min(1024, model.config.max_position_embeddings),
        num_kv_blocks=max_num_seqs * 1024 // 16 + 64,
        **kwargs,
    )
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(config, SpeculativeConfig.from_dict(spec), model=model, tokenizer=None)
    return llm


def engine_tpot(llm, prompts, new_tokens: int, speculative=None) -> dict:
    """Wall time of the decode phase per output token: (t(1 + n) - t(1)) / n, each t the
    median of three runs."""
    from specdec.sampling import SamplingParams

    def run(max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, speculative=speculative)
        torch.cuda.synchronize()
        return time.perf_counter() - start, outputs

    run(1 + new_tokens)  # warm-up: captures the graphs this batch size needs
    # Medians of three: one prefill of 64 prompts varied by ~50 ms between runs (session 4),
    # which a single pair of runs puts straight into the TPOT.
    prefill_s = statistics.median(run(1)[0] for _ in range(3))
    totals = [run(1 + new_tokens) for _ in range(3)]
    total_s = statistics.median(t for t, _ in totals)
    outputs = totals[-1][1]
    tpot_ms = (total_s - prefill_s) / new_tokens * 1e3
    emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tpot_ms": tpot_ms,
        "tokens_per_s": len(prompts) * new_tokens / (total_s - prefill_s),
        "prefill_s": prefill_s,
        "total_s": total_s,
        "emitted": emitted,
    }


def bench_ours(shapes, batches, new_tokens: int, plain_only: bool = False) -> dict:
    results: dict = {}
    for shape in shapes:
        model = build_ours(shape)
        log(f"[ours] {shape}: built")
        plain = make_llm(model, async_scheduling=False)
        rows = {}
        for batch in batches:
            prompts = random_prompts(batch, hf_config(shape)["vocab_size"], seed=batch)
            row = engine_tpot(plain, prompts, new_tokens)
            graphs = plain.engine.runner.graphs
            bucket = next(size for size in graphs.buckets if size >= batch)
            row["graph_replay_ms"] = cuda_ms(graphs.graphs[(bucket, 1, ())][0].replay, 50)
            rows[batch] = row
            log(f"[ours] {shape} b{batch}: {row}")
        del plain
        torch.cuda.empty_cache()
        # The same workload with async_scheduling: host work overlapped with the GPU.
        overlapped = make_llm(model, async_scheduling=True)
        async_rows = {}
        for batch in batches:
            prompts = random_prompts(batch, hf_config(shape)["vocab_size"], seed=batch)
            async_rows[batch] = engine_tpot(overlapped, prompts, new_tokens)
            log(f"[ours] {shape} b{batch} async_scheduling: {async_rows[batch]}")
        del overlapped
        torch.cuda.empty_cache()
        if plain_only:
            results[shape] = {"plain": rows, "plain_async_scheduling": async_rows}
            del model
            torch.cuda.empty_cache()
            continue
        # Verification cost: one runner step (host preparation + graph replay) with K + 1 = 5
        # query tokens per request against one with 1.
        from specdec.runner.model_runner import PagedModelRunner

        runner = PagedModelRunner(
            model, 64 * 40 + 8, 16, max_num_seqs=64, max_model_len=640, max_query_len=5
        )
        verify_cost = {}
        for batch in (1, 2, 4, 8, 64):
            times = {}
            for query_len in (1, 5):
                tokens = [[7] * query_len for _ in range(batch)]
                starts = [512] * batch
                blocks = [list(range(b * 40, b * 40 + 40)) for b in range(batch)]
                times[query_len] = cuda_ms(
                    lambda t=tokens, s=starts, bl=blocks, r=runner: r.graphs.run(t, s, bl), 30
                )
            verify_cost[batch] = {
                "decode_step_ms": times[1],
                "verify_step_ms": times[5],
                "ratio": times[5] / times[1],
            }
            log(f"[ours] {shape} verify cost b{batch}: {verify_cost[batch]}")
        del runner
        torch.cuda.empty_cache()
        # Speculative vs plain in the engine (batch 1 and 8): n-gram on a repetitive prompt, and
        # a draft model made of the target's first 2 layers.
        spec_rows = {}
        vocab = hf_config(shape)["vocab_size"]
        pattern = random_prompts(1, vocab, seed=99, length=16)[0]
        for batch in (1, 8):
            repetitive = [pattern * 8 for _ in range(batch)]
            varied = random_prompts(batch, vocab, seed=1000 + batch)
            for name, spec, prompts in (
                ("plain, repetitive prompts", None, repetitive),
                (
                    "ngram K=4, repetitive prompts",
                    {"method": "ngram", "num_speculative_tokens": 4},
                    repetitive,
                ),
                ("plain, random prompts", None, varied),
                (
                    "draft_model truncated:2 K=4, random prompts",
                    {"method": "draft_model", "model": "truncated:2", "num_speculative_tokens": 4},
                    varied,
                ),
            ):
                llm = make_llm(model, spec, max_num_seqs=8)
                row = engine_tpot(llm, prompts, new_tokens)
                metrics = llm.get_metrics()
                if metrics.get("num_drafts"):
                    row["mean_acceptance_length"] = (
                        1 + metrics["num_accepted_tokens"] / metrics["num_drafts"]
                    )
                spec_rows[f"b{batch}: {name}"] = row
                log(f"[ours] {shape} b{batch} {name}: {row}")
                del llm
                torch.cuda.empty_cache()
        results[shape] = {
            "plain": rows,
            "plain_async_scheduling": async_rows,
            "verify_cost": verify_cost,
            "speculative": spec_rows,
        }
        del model
        torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------- transformers
def bench_hf(shapes, batches, new_tokens: int, caches) -> dict:
    import transformers

    results: dict = {"transformers": transformers.__version__}
    for shape in shapes:
        cfg = hf_config(shape)
        config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
        log(f"[hf] {shape}: built")
        for cache in caches:
            # The static cache at batch 1 recompiles every step (333-748 ms/token seen on this
            # H200 before); it is left out to keep the run short.
            for batch in [b for b in batches if cache == "dynamic" or b > 1]:
                prompts = torch.tensor(random_prompts(batch, cfg["vocab_size"], seed=batch))
                input_ids = prompts.cuda()
                mask = torch.ones_like(input_ids)

                def run(n: int, cache=cache, input_ids=input_ids, mask=mask, model=model) -> float:
                    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    with torch.no_grad():
                        model.generate(
                            input_ids,
                            attention_mask=mask,
                            max_new_tokens=n,
                            min_new_tokens=n,
                            do_sample=False,
                            pad_token_id=0,
                            **kwargs,
                        )
                    torch.cuda.synchronize()
                    return time.perf_counter() - start

                n = new_tokens
                run(n)  # warm-up (and compile, for the static cache)
                one = run(1)
                total = run(1 + n)
                row = {"ms_per_step": (total - one) / n * 1e3, "new_tokens": n}
                row["tokens_per_s"] = batch * 1e3 / row["ms_per_step"]
                results[f"{shape} {cache} b{batch}"] = row
                log(f"[hf] {shape} {cache} b{batch}: {row}")
        del model
        torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------- gpt-fast
def bench_gpt_fast(shapes, batches, new_tokens: int, gpt_fast_dir: str) -> dict:
    sys.path.insert(0, gpt_fast_dir)
    import generate as gf_generate  # gpt-fast's generate.py
    from model import ModelArgs, Transformer  # gpt-fast's model.py

    decode = torch.compile(gf_generate.decode_one_token, mode="reduce-overhead", fullgraph=True)
    results: dict = {}
    for shape in shapes:
        cfg = hf_config(shape)
        args = ModelArgs(
            block_size=8192,
            vocab_size=cfg["vocab_size"],
            n_layer=cfg["num_hidden_layers"],
            n_head=cfg["num_attention_heads"],
            n_local_heads=cfg["num_key_value_heads"],
            dim=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            rope_base=cfg["rope_theta"],
        )
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Transformer(args).to(torch.bfloat16).eval()
        for batch in batches:
            with torch.device("cuda"):
                model.setup_caches(max_batch_size=batch, max_seq_length=512)
            vocab = cfg["vocab_size"]
            prompt = torch.tensor(random_prompts(batch, vocab, seed=batch)).cuda()
            input_pos = torch.arange(PROMPT_LEN, device="cuda")
            with torch.no_grad():
                token = gf_generate.prefill(model, prompt, input_pos)
            start_compile = time.perf_counter()
            pos = torch.tensor([PROMPT_LEN], device="cuda")

            def step(token=token, pos=pos, model=model, batch=batch):
                with (
                    torch.no_grad(),
                    torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
                ):
                    return decode(model, token.view(batch, 1), pos)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start_compile
            ms = cuda_ms(step, new_tokens)
            row = {"ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "compile_s": compile_s}
            results[f"{shape} b{batch}"] = row
            log(f"[gpt-fast] {shape} b{batch}: {row}")
        del model
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="ours,gptfast,hf")
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-new-tokens", type=int, default=16)
    parser.add_argument("--hf-caches", default="dynamic,static")
    parser.add_argument("--gpt-fast-dir", default=".peers/gpt-fast")
    parser.add_argument("--gpt-fast-batches", default="1,64")
    parser.add_argument("--plain-only", action="store_true", help="ours: plain decoding only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    for part in args.parts.split(","):
        start = time.perf_counter()
        if part == "ours":
            result = bench_ours(shapes, batches, args.new_tokens, args.plain_only)
        elif part == "hf":
            result = bench_hf(shapes, batches, args.hf_new_tokens, args.hf_caches.split(","))
        elif part == "gptfast":
            gf_batches = [int(b) for b in args.gpt_fast_batches.split(",")]
            result = bench_gpt_fast(shapes, gf_batches, args.new_tokens, args.gpt_fast_dir)
        else:
            raise SystemExit(f"unknown part {part!r}")
        result["meta"] = {**meta, "seconds": time.perf_counter() - start}
        (out / f"{part}.json").write_text(json.dumps(result, indent=1))
        log(f"[{part}] done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
