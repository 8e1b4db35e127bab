"""The engine's ceiling beside the server's figures: the same requests through `LLM.chat` in this
process, a closed batch per concurrency level (`--generate`)."""

from __future__ import annotations

import argparse
import gc
import time

from specdec.bench_serve.client import WARMUP_MAX_TOKENS, LevelResult, print_level, prompt


def server_max_num_seqs(args: argparse.Namespace) -> int:
    """The started server's max_num_seqs: a --serve-arg=--max-num-seqs=N, else the engine's
    default."""
    from specdec.engine.config import EngineConfig

    for flag in args.serve_arg:
        name, _, value = flag.partition("=")
        if name == "--max-num-seqs" and value:
            return int(value)
    return EngineConfig.__dataclass_fields__["max_num_seqs"].default


def loop_counters(stats: dict) -> dict[str, float]:
    """An engine's `LoopStats.as_dict()` under the names of the server's counters
    (`engine_counters`), so that in-process levels fill the same paths table."""
    counters = {
        f"specdec:{name}_total": float(value)
        for name, value in stats.items()
        if name.startswith("num_")
    }
    for kind, count in stats.get("rows", {}).items():
        counters[f"specdec:num_rows_total[kind={kind}]"] = float(count)
    for k, count in stats.get("k_chosen", {}).items():
        counters[f"specdec:spec_k_chosen_total[k={k}]"] = float(count)
    return counters


def generate_levels(args: argparse.Namespace, by_level: dict | None = None) -> list[LevelResult]:
    """`LLM.chat` on each concurrency level's requests in this process (a closed batch of
    max_num_seqs = the concurrency, capped at the server's own max_num_seqs as the server caps
    the streams it runs at once; warmed up as the server is), plain and spec: what the engine
    delivers without the server. Only throughput is measured (NaN latencies); `by_level`, if
    given, receives each level's step counters as the timed run grew them (`loop_counters`).
    (Before s32 the batch was the concurrency uncapped: at c = 256 it ran 256 sequences against
    the server's 64.)"""
    import torch

    from specdec import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    levels = []
    for spec in (False, True):
        for concurrency in args.concurrency:
            llm = LLM(
                model=args.serve or None,  # none: the built-in model
                device=args.device,
                dtype=args.dtype,
                max_num_seqs=min(concurrency, server_max_num_seqs(args)),
                speculative_config=(args.speculative_config or "auto") if spec else None,
                **(
                    {"max_model_len": args.generate_max_model_len}
                    if args.generate_max_model_len
                    else {}
                ),
            )
            # As `specdec serve` does before its first request: every step shape's CUDA graph
            # captured now, not in the timed run (s30: without it the speculative ceiling read
            # 1,088 / 3,868 tokens/s at c = 1 / 16 on an H100, below the server's own figures).
            llm.engine.warm_up(progress=False)
            num_requests = max(concurrency, args.requests_per_level)
            chats = [[{"role": "user", "content": prompt(i)}] for i in range(num_requests)]
            params = [
                SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=i,
                    ignore_eos=True,
                )
                for i in range(num_requests)
            ]
            warm = [SamplingParams(max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True, seed=0)]
            llm.chat(
                chats[:1] * min(concurrency, num_requests),
                warm * min(concurrency, num_requests),
                use_tqdm=False,
            )
            before = loop_counters(llm.engine.loop_stats.as_dict())
            started = time.perf_counter()
            outputs = llm.chat(chats, params, use_tqdm=False)
            duration = time.perf_counter() - started
            after = loop_counters(llm.engine.loop_stats.as_dict())
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            stats = llm.get_metrics()
            drafts = stats.get("num_drafts", 0)
            accepted = stats.get("num_accepted_tokens", 0)
            latencies = {
                f"{name}_{q}_ms": float("nan")
                for name in ("ttft", "tpot", "itl")
                for q in ("p50", "p90", "p99")
            }
            levels.append(
                LevelResult(
                    mode="generate spec" if spec else "generate plain",
                    concurrency=concurrency,
                    request_rate=None,
                    num_requests=num_requests,
                    num_failed=0,
                    duration_s=duration,
                    requests_per_s=num_requests / duration,
                    output_tokens_per_s=tokens / duration,
                    mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
                    **latencies,
                )
            )
            print_level(levels[-1])
            if by_level is not None:
                by_level[f"{levels[-1].mode} {levels[-1].label}"] = {
                    name: value - before.get(name, 0.0) for name, value in after.items()
                }
            # The next level's engine sizes its KV cache from the memory free then: this one's
            # (held in reference cycles until collected) must be gone (s32: a second LLM in one
            # process ran out of memory on an H100 without this).
            del llm, outputs
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return levels
