"""The speculative round on the GPU: speculation against plain decoding in one process.

Parts (each writes DIR/<part>.json; BENCHMARKS.md's tables are read from them):
- `smollm2`: the built-in SmolLM2-135M-Instruct GGUF with the shipped EAGLE head on the held-out
  prompts, batch 1 / 8 / 32 / 64, T = 0 and 1: plain decoding, K = 2, 3, 4 pinned, and the
  adaptive policy (K <= 4), without and with its plain arm (`plain_arm`: plain overlapped steps
  when they beat every round); output tokens per second of whole generate calls, and of the
  profiled call without its first step (`after_first_step`: the prefill and, with speculation,
  the start of the rounds; `speedup_after_first_step`), and `paired`: 5 more calls of each
  speculative configuration alternating with calls of the plain engine (kept alive beside it),
  each pair's speed-up and their median, the figure to read when the machine's rate drifts.
  `--smollm2-configs plain,adaptive,plain-arm` runs only the configurations whose name holds one
  of those words.
- `block`: DFlash and DSpark on the built-in SmolLM2 (checkpoints from `--block-drafters`, else
  drafters started from the target's own weights: their acceptance means little, their rounds'
  cost is what is measured), K = 3 pinned, T = 0 and 1, batch 1 and 8: the synchronous step
  against the rounds on the device (which must emit the same tokens: `same_tokens`), and plain
  decoding.
- `oracle`: Llama-3.2-1B and Llama-3-8B shapes with random bf16 weights and the benchmark-only
  oracle drafter (`oracle_drafter.py`: the target's own greedy continuation, each draft replaced
  with probability 1 - a), K = 4, a in {0.6, 0.8}, batch 1 and 8; against the ideal
  E[tokens per round] x t_plain_step / t_round_floor, with the decode and verify steps' graph
  replays as t_plain_step and t_round_floor; the round's own graph replay against the measured
  time between round launches; plain TPOT at batch 1 and 64.
- `eagle3`: a random EAGLE-3 head (vLLM's format, written for the target's shape) on the
  `--shapes` targets with random weights, K = 4 pinned, batch 1: the interval between round
  launches and the round graph's replay against the target's verify step (issue 36: <= 1.15x).

    python benchmarks/bench_spec_round.py --out DIR [--parts smollm2,oracle,block,eagle3]
        [--gguf PATH] [--shapes llama-3.2-1b,llama-3-8b] [--device cuda]
        [--block-drafters DFLASH_DIR,DSPARK_DIR]

`--device cpu --shapes tiny` runs the same code on a CPU in seconds (a smoke test, not a
figure). Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_gpu_engine import SHAPES, build_ours, hf_config, random_prompts
from oracle_drafter import OracleDrafter

HERE = Path(__file__).resolve().parent
PROMPT_LEN = 128


def log(*args) -> None:
    print(*args, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_engine(
    model, tokenizer, spec, *, device, max_num_seqs, max_model_len, blocks, async_scheduling=True
):
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm import LLM
    from specdec.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        num_kv_blocks=blocks,
        async_scheduling=async_scheduling,
    )
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(
        config, SpeculativeConfig.from_dict(spec), model=model, tokenizer=tokenizer
    )
    return llm


CAPTURES = [0]  # CUDA graphs captured in this process so far


def count_captures() -> None:
    """Counts every graph capture (`GraphCache._capture`) in CAPTURES."""
    from specdec.runner.cuda_graph import GraphCache

    inner = GraphCache._capture
    if getattr(inner, "counted", False):
        return

    def capture(self, step, state):
        CAPTURES[0] += 1
        return inner(self, step, state)

    capture.counted = True
    GraphCache._capture = capture


def timed(llm, prompts, params, device, repeats: int = 2, warmups: int = 4) -> tuple[float, list]:
    """Median seconds of `repeats` generate calls and the outputs, after warm-up calls until one
    captures no new CUDA graph (at most `warmups`: which graphs a run needs depends on when its
    requests finish); the last call's engine steps are timed on the host (`llm.step_profile`),
    and the captures during the timed calls are counted (`llm.timed_captures`)."""
    count_captures()
    for _ in range(warmups):
        before = CAPTURES[0]
        llm.generate(prompts, params, use_tqdm=False)
        if CAPTURES[0] == before:
            break
    times, outputs = [], None
    before = CAPTURES[0]
    policy = getattr(llm.engine, "policy", None)
    llm.chosen_before = dict(policy.chosen) if policy is not None else {}
    for repeat in range(repeats):
        if repeat == repeats - 1:
            profile_steps(llm)
        sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        times.append(time.perf_counter() - start)
    llm.timed_captures = CAPTURES[0] - before
    llm.last_call_seconds = times[-1]  # the profiled call
    llm.engine.__dict__.pop("step", None)  # the profiler's wrapper (later calls run bare)
    return statistics.median(times), outputs


def paired(plain_llm, llm, prompts, params, device, pairs: int = 5) -> dict:
    """Alternating calls of plain decoding and `llm` (both warmed up by `timed`), each pair's
    speed-up (both emit the same number of tokens: EOS ignored, a fixed `max_tokens`): a drift of
    the machine's rate between configurations moves both sides of a pair alike, where a
    configuration timed minutes after plain decoding is compared with a rate the machine no
    longer has (s13's batch-1 figure: 1.57x against a plain run 16% slower than s14's)."""
    plain_times, times, ratios = [], [], []
    for _ in range(pairs):
        for engine, into in ((plain_llm, plain_times), (llm, times)):
            sync(device)
            start = time.perf_counter()
            outputs = engine.generate(prompts, params, use_tqdm=False)
            sync(device)
            into.append(time.perf_counter() - start)
        ratios.append(plain_times[-1] / times[-1])
    emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "speedup": statistics.median(ratios),
        "ratios": [round(r, 4) for r in ratios],
        "plain_tokens_per_s": emitted / statistics.median(plain_times),
        "tokens_per_s": emitted / statistics.median(times),
    }


def profile_steps(llm) -> None:
    """Wraps the engine's `step`: each call's host seconds and the loop it served (rounds,
    the plain arm, the overlapped plain loop or the synchronous step) land in
    `llm.step_profile`."""
    engine = llm.engine
    inner = engine.step
    llm.step_profile = []

    def step(*args, **kwargs):
        mode = (
            "rounds"
            if getattr(engine, "_in_rounds", False)
            else "plain-arm"
            if getattr(engine, "_in_plain", False)
            else "step"
        )
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        llm.step_profile.append((time.perf_counter() - start, mode))
        return out

    engine.step = step


def profile_summary(llm) -> dict | None:
    steps = getattr(llm, "step_profile", None)
    if not steps:
        return None
    by_mode: dict[str, list[float]] = {}
    for seconds, mode in steps:
        by_mode.setdefault(mode, []).append(seconds)
    slowest = sorted(steps, reverse=True)[:8]
    return {
        "calls": {m: len(v) for m, v in by_mode.items()},
        "ms": {m: round(sum(v) * 1e3, 3) for m, v in by_mode.items()},
        "slowest_ms": [[round(s * 1e3, 3), m] for s, m in slowest],
    }


def figures(llm, seconds: float, outputs) -> dict:
    metrics = llm.get_metrics()
    emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
    policy = getattr(llm.engine, "policy", None)
    costs = None
    if policy is not None:
        costs = {
            f"bucket {b} K={k}": [round(sec * 1e3, 4), n]
            for (b, k), (sec, n) in sorted(policy.costs().items(), key=lambda i: str(i[0]))
        }
    decode = None
    steps = getattr(llm, "step_profile", None)
    if steps and getattr(llm, "last_call_seconds", None):
        # The profiled call without its first step (the prefill, with speculation also the
        # start of the rounds), which emits each request's first token.
        first = steps[0][0]
        decode = {
            "first_step_ms": round(first * 1e3, 3),
            "tokens_per_s": (emitted - len(outputs)) / max(llm.last_call_seconds - first, 1e-9),
        }
    return {
        "seconds": seconds,
        "tokens_per_s": emitted / seconds,
        "after_first_step": decode,
        "mean_acceptance_length": metrics["mean_acceptance_length"],
        "loop": metrics["loop"],
        "policy_costs_ms": costs,
        "acceptance": None
        if policy is None
        else [policy.acceptance(i) for i in range(policy.max_k)],
        "k_chosen_while_timed": None
        if policy is None
        else {
            k: n - getattr(llm, "chosen_before", {}).get(k, 0)
            for k, n in sorted(policy.chosen.items())
            if n - getattr(llm, "chosen_before", {}).get(k, 0)
        },
        "steps": profile_summary(llm),
        "captures_while_timed": getattr(llm, "timed_captures", None),
    }


def replay_ms(graph, device: str, iters: int = 20) -> float | None:
    if device != "cuda":
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# --------------------------------------------------------------------------- SmolLM2
def load_smollm2(gguf: str | None, device: str):
    """(model, tokenizer, the held-out prompts as chat token ids, the shipped head's config)
    of the built-in SmolLM2 GGUF (or `gguf`), bf16 on CUDA."""
    from specdec.drafters.default import default_speculative_config
    from specdec.models import default_model_path, load_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = load_model(gguf or str(default_model_path()), dtype=dtype, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    lines = (HERE / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    encoded = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    return model, tokenizer, encoded, default_speculative_config(None, device)


def smollm2_batch(encoded, batch: int, output_len: int, temperature: float):
    """(prompts, KV blocks that hold them all, per-request SamplingParams) of one batch: the
    held-out prompts cycled to `batch`, `output_len` tokens each, EOS ignored, seeds 0.."""
    from specdec.sampling import SamplingParams

    prompts = (encoded * batch)[:batch]
    longest = max(map(len, prompts)) + output_len + 8
    blocks = batch * (-(-longest // 16) + 2) + 64
    params = [
        SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=i)
        for i in range(batch)
    ]
    return prompts, blocks, params


def bench_smollm2(
    gguf: str | None,
    device: str,
    output_len: int,
    batches,
    only: list[str] | None = None,
    save=None,
    head_dir: str | None = None,
) -> dict:
    """`save(results)`, when given, is called after every row (a later failure keeps them); a
    configuration that fails is recorded with its error and the others go on. `head_dir`: an
    EAGLE head directory in place of the shipped one."""
    model, tokenizer, encoded, head = load_smollm2(gguf, device)
    if head_dir is not None:
        head = {**(head or {"method": "eagle"}), "model": head_dir}
    results = {"num_prompts": len(encoded), "output_len": output_len, "rows": {}}
    for batch in batches:
        common = {"device": device, "max_num_seqs": batch, "max_model_len": 1024}
        ks = (2, 3, 4) if batch <= 8 else (2,)
        for temperature in (0.0, 1.0):
            prompts, blocks, params = smollm2_batch(encoded, batch, output_len, temperature)
            configs = {"plain": None}
            configs.update(
                {
                    f"eagle K={k}": {**head, "num_speculative_tokens": k, "adaptive": False}
                    for k in ks
                }
            )
            # The default policy (over device rounds alone), and with its plain arm.
            configs["eagle adaptive K<=4"] = {**head, "num_speculative_tokens": 4, "adaptive": True}
            configs["eagle adaptive plain-arm K<=4"] = {
                **configs["eagle adaptive K<=4"],
                "plain_arm": True,
            }
            if only:  # "plain" always runs: the speed-ups are against it
                configs = {
                    n: c for n, c in configs.items() if n == "plain" or any(w in n for w in only)
                }
            plain_rate, plain_decode, plain_llm = None, None, None
            for name, spec in configs.items():
                llm = None
                try:
                    llm = make_engine(model, tokenizer, spec, blocks=blocks, **common)
                    seconds, outputs = timed(llm, prompts, params, device, repeats=5)
                    row = figures(llm, seconds, outputs)
                    if name != "plain" and plain_llm is not None:
                        # Beside plain decoding, call for call (its engine kept alive).
                        row["paired"] = paired(plain_llm, llm, prompts, params, device)
                except Exception as error:  # recorded; the other configurations go on
                    results["rows"][f"b{batch} T={temperature:g} {name}"] = {"error": repr(error)}
                    log(f"[smollm2] b{batch} T={temperature:g} {name}: FAILED {error!r}")
                    del llm
                    continue
                if name == "plain":
                    plain_rate, plain_decode = row["tokens_per_s"], row["after_first_step"]
                    plain_llm = llm
                row["speedup"] = row["tokens_per_s"] / plain_rate
                if row["after_first_step"] and plain_decode:
                    row["speedup_after_first_step"] = (
                        row["after_first_step"]["tokens_per_s"] / plain_decode["tokens_per_s"]
                    )
                results["rows"][f"b{batch} T={temperature:g} {name}"] = row
                log(f"[smollm2] b{batch} T={temperature:g} {name}: {row}")
                if save is not None:
                    save(results)
                del llm
                if device == "cuda":
                    torch.cuda.empty_cache()
            del plain_llm
    return results


# --------------------------------------------------------------------------- block drafters
def block_drafter_dirs(model, given: str | None, root: Path) -> dict[str, str]:
    """kind -> checkpoint directory: the given ones, else drafters started from the target's
    weights (`init_from_target`; DSpark's confidence head at c = 1/2, so that with a minimum
    survival of 0.1 its scheduler runs and admits 3 drafts)."""
    from specdec.drafters.block.checkpoint import save_block_drafter
    from specdec.drafters.block.network import (
        BlockDrafterConfig,
        default_feature_layers,
        init_from_target,
    )

    if given:
        dflash, dspark = given.split(",")
        return {"dflash": dflash, "dspark": dspark}
    config = model.config
    dirs = {}
    for kind in ("dflash", "dspark"):
        drafter_config = BlockDrafterConfig(
            kind=kind,
            feature_layers=default_feature_layers(config.num_hidden_layers),
            target_hidden_size=config.hidden_size,
            target_vocab_size=config.vocab_size,
            target_num_hidden_layers=config.num_hidden_layers,
            block_size=4,
            markov_rank=32 if kind == "dspark" else 0,
            min_survival_probability=0.1 if kind == "dspark" else 0.0,
        )
        dirs[kind] = str(save_block_drafter(init_from_target(drafter_config, model), root / kind))
    return dirs


def bench_block(gguf: str | None, device: str, output_len: int, batches, given, root) -> dict:
    from specdec.models import default_model_path, load_model
    from specdec.sampling import SamplingParams

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = load_model(gguf or str(default_model_path()), dtype=dtype, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    dirs = block_drafter_dirs(model, given, root)
    lines = (HERE / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    encoded = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    results = {"drafters": dirs, "output_len": output_len, "rows": {}}
    for batch in batches:
        prompts = (encoded * batch)[:batch]
        longest = max(map(len, prompts)) + output_len + 8
        blocks = batch * (-(-longest // 16) + 2) + 64
        common = {"device": device, "max_num_seqs": batch, "max_model_len": 1024}
        for temperature in (0.0, 1.0):
            params = [
                SamplingParams(
                    temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=i
                )
                for i in range(batch)
            ]
            llm = make_engine(model, tokenizer, None, blocks=blocks, **common)
            seconds, outputs = timed(llm, prompts, params, device)
            plain_rate = figures(llm, seconds, outputs)["tokens_per_s"]
            results["rows"][f"b{batch} T={temperature:g} plain"] = {"tokens_per_s": plain_rate}
            del llm
            for kind, path in dirs.items():
                spec = {"method": kind, "model": path, "num_speculative_tokens": 3}
                spec["adaptive"] = False
                tokens = {}
                for path_name, overlap in (("sync", False), ("device rounds", True)):
                    llm = make_engine(
                        model, tokenizer, spec, blocks=blocks, async_scheduling=overlap, **common
                    )
                    seconds, outputs = timed(llm, prompts, params, device)
                    row = figures(llm, seconds, outputs)
                    row["speedup"] = row["tokens_per_s"] / plain_rate
                    tokens[path_name] = [o.outputs[0].token_ids for o in outputs]
                    name = f"b{batch} T={temperature:g} {kind} K=3 {path_name}"
                    results["rows"][name] = row
                    log(f"[block] {name}: {row}")
                    del llm
                    if device == "cuda":
                        torch.cuda.empty_cache()
                same = tokens["sync"] == tokens["device rounds"]
                results["rows"][f"b{batch} T={temperature:g} {kind} K=3 device rounds"][
                    "same_tokens"
                ] = same
    return results


# --------------------------------------------------------------------------- oracle
def decode_phase(llm, prompts, new_tokens: int, device: str) -> tuple[float, list]:
    """Seconds per output token of the decode phase: (t(1 + n) - t(1)) / n (medians of 2)."""
    from specdec.sampling import SamplingParams

    def run(max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return timed(llm, prompts, params, device)

    one, _ = run(1)
    total, outputs = run(1 + new_tokens)
    return (total - one) / new_tokens, outputs


def step_graph(graphs, bucket: int, query: int):
    """The decode path's graph of a plain step of `query` rows a sequence at `bucket` (no
    features, no tree, every row's logits, no split-KV): its key's first three fields, the rest
    off."""
    matches = [
        graph
        for key, (graph, _) in graphs.graphs.items()
        if key[:3] == (bucket, query, ()) and not any(key[3:])
    ]
    if len(matches) != 1:
        raise RuntimeError(f"{len(matches)} graphs of ({bucket}, {query}): {list(graphs.graphs)}")
    return matches[0]


def bench_oracle(shapes, device: str, new_tokens: int, batches, acceptances) -> dict:
    from specdec.runner.cuda_graph import bucket_for

    results = {}
    k = 4
    for shape in shapes:
        model = build_ours(shape) if device == "cuda" else tiny_model(shape)
        vocab = model.config.vocab_size
        for batch in batches:
            prompts = random_prompts(batch, vocab, seed=batch)
            blocks = batch * (-(-(PROMPT_LEN + new_tokens + 16) // 16) + 2) + 64
            common = {"device": device, "max_num_seqs": max(batch, 8), "max_model_len": 1024}
            plain = make_engine(model, None, None, blocks=blocks, **common)
            plain_s, outputs = decode_phase(plain, prompts, new_tokens, device)
            sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
            row = {"plain_tpot_ms": plain_s * 1e3}
            del plain
            # The floors: the target's decode (1 token) and verify (K + 1 tokens) steps alone.
            floors = make_engine(
                model,
                None,
                {"method": "ngram", "num_speculative_tokens": k},
                blocks=blocks,
                **common,
            )
            graphs = floors.engine.runner.graphs
            bucket = bucket_for(graphs.buckets, batch)
            starts, tables = (
                [PROMPT_LEN] * batch,
                [list(range(b * 12, b * 12 + 12)) for b in range(batch)],
            )
            for width in (1, k + 1):
                graphs.run([[7] * width] * batch, starts, tables)
            if device == "cuda":
                row["decode_step_ms"] = replay_ms(step_graph(graphs, bucket, 1), device)
                row["verify_step_ms"] = replay_ms(step_graph(graphs, bucket, k + 1), device)
            del floors
            for a in acceptances:
                spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
                llm = make_engine(model, None, spec, blocks=blocks, **common)
                llm.engine.drafter = OracleDrafter(vocab, a, sequences, PROMPT_LEN)
                spec_s, _ = decode_phase(llm, prompts, new_tokens, device)
                metrics = llm.get_metrics()
                rounds = llm.engine._rounds
                entry = {
                    "tpot_ms": spec_s * 1e3,
                    "speedup": plain_s / spec_s,
                    "mean_acceptance_length": metrics["mean_acceptance_length"],
                    "expected_tokens_per_round": sum(a**i for i in range(k + 1)),
                    "loop": metrics["loop"],
                }
                # (None: the first round after each `begin`, which has no previous one)
                intervals = [] if rounds is None else [s for s in rounds.round_seconds if s]
                if intervals:
                    entry["round_launch_interval_ms_median"] = statistics.median(intervals) * 1e3
                    key = next(iter(rounds.graph_cache.graphs), None)
                    if key is not None:
                        entry["round_graph_ms"] = replay_ms(
                            rounds.graph_cache.graphs[key][0], device
                        )
                if "verify_step_ms" in row:
                    ideal = (
                        entry["mean_acceptance_length"]
                        * row["decode_step_ms"]
                        / row["verify_step_ms"]
                    )
                    entry["ideal_speedup"] = ideal
                    entry["fraction_of_ideal"] = entry["speedup"] / ideal
                row[f"oracle a={a}"] = entry
                log(f"[oracle] {shape} b{batch} a={a}: {entry}")
                del llm
                if device == "cuda":
                    torch.cuda.empty_cache()
            results[f"{shape} b{batch}"] = row
            log(f"[oracle] {shape} b{batch}: {row}")
        # Plain decoding at batch 64 beside batch 1 (that it did not get slower).
        prompts = random_prompts(64, vocab, seed=64)
        blocks = 64 * (-(-(PROMPT_LEN + new_tokens + 16) // 16) + 2) + 64
        plain = make_engine(
            model, None, None, blocks=blocks, device=device, max_num_seqs=64, max_model_len=1024
        )
        results[f"{shape} b64 plain_tpot_ms"] = (
            decode_phase(plain, prompts, new_tokens, device)[0] * 1e3
        )
        log(f"[oracle] {shape} b64 plain: {results[f'{shape} b64 plain_tpot_ms']:.3f} ms")
        del plain, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def eagle3_checkpoint(config, path: Path, draft_vocab: int, device: str) -> Path:
    """A random EAGLE-3 head for a target of `config` (a `ModelConfig`), written as vLLM names
    it (`Eagle3LlamaForCausalLM`: `fc` over three captured layers, the midlayer whose q/k/v
    read [embedding, hidden] 2H wide, `norm`, `lm_head` over a draft vocabulary of the first
    `draft_vocab` target ids, `d2t` / `t2d`), in bfloat16 on CUDA, float32 on the CPU."""
    from safetensors.torch import save_file

    dim, heads = config.hidden_size, config.num_attention_heads
    kv_heads = config.num_key_value_heads
    head_dim, inner, vocab = config.head_dim, config.intermediate_size, config.vocab_size
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = {
        "fc.weight": (dim, 3 * dim),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * dim),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * dim),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * dim),
        "midlayer.self_attn.o_proj.weight": (dim, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inner, dim),
        "midlayer.mlp.up_proj.weight": (inner, dim),
        "midlayer.mlp.down_proj.weight": (dim, inner),
        "lm_head.weight": (draft_vocab, dim),
    }
    generator = torch.Generator(device=device).manual_seed(3)
    tensors = {
        name: torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
        for name, shape in shapes.items()
    }
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = torch.ones(dim, dtype=dtype, device=device)
    tensors["norm.weight"] = torch.ones(dim, dtype=dtype, device=device)
    tensors = {name: t.cpu().contiguous() for name, t in tensors.items()}
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)  # draft id i -> target id i
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    tensors["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    layer = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": dim,
        "intermediate_size": inner,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "vocab_size": vocab,
    }
    head_config = {
        "architectures": ["Eagle3LlamaForCausalLM"],
        **layer,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(head_config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def bench_eagle3(shapes, device: str, new_tokens: int, root: Path) -> dict:
    """Issue 36's speed target: an EAGLE-3 round at K = 4 (random head and target: every round
    drafts 4, acceptance is irrelevant here) against the target's verify step alone, batch 1:
    the median interval between round launches and the round graph's replay, over the verify
    (K + 1 = 5 rows) and decode steps' graph replays."""
    from specdec.runner.cuda_graph import bucket_for

    results = {}
    k, batch = 4, 1
    for shape in shapes:
        model = build_ours(shape) if device == "cuda" else tiny_model(shape, layers=8)
        config = model.config
        draft_vocab = min(32000, config.vocab_size // 2)
        head = eagle3_checkpoint(config, root / f"eagle3-{shape}", draft_vocab, device)
        prompts = random_prompts(batch, config.vocab_size, seed=1)
        blocks = batch * (-(-(PROMPT_LEN + new_tokens + 16) // 16) + 2) + 64
        common = {"device": device, "max_num_seqs": 8, "max_model_len": 1024}
        floors = make_engine(
            model, None, {"method": "ngram", "num_speculative_tokens": k}, blocks=blocks, **common
        )
        row: dict = {"draft_vocab": draft_vocab}
        graphs = floors.engine.runner.graphs
        if graphs is not None and device == "cuda":
            bucket = bucket_for(graphs.buckets, batch)
            tables = [list(range(12))]
            for width in (1, k + 1):
                graphs.run([[7] * width], [PROMPT_LEN], tables)
            row["decode_step_ms"] = replay_ms(step_graph(graphs, bucket, 1), device)
            row["verify_step_ms"] = replay_ms(step_graph(graphs, bucket, k + 1), device)
        del floors
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
        llm = make_engine(model, None, {**spec, "adaptive": False}, blocks=blocks, **common)
        spec_s, _ = decode_phase(llm, prompts, new_tokens, device)
        rounds = llm.engine._rounds
        row["tpot_ms"] = spec_s * 1e3
        row["mean_acceptance_length"] = llm.get_metrics()["mean_acceptance_length"]
        row["loop"] = llm.get_metrics()["loop"]
        intervals = [] if rounds is None else [s for s in rounds.round_seconds if s]
        if intervals:
            row["round_launch_interval_ms_median"] = statistics.median(intervals) * 1e3
            key = next(iter(rounds.graph_cache.graphs), None)
            if key is not None:
                row["round_graph_ms"] = replay_ms(rounds.graph_cache.graphs[key][0], device)
        if "verify_step_ms" in row:
            for name in ("round_launch_interval_ms_median", "round_graph_ms"):
                if name in row:
                    row[name.replace("_ms", "") + "_over_verify_step"] = (
                        row[name] / row["verify_step_ms"]
                    )
        results[f"{shape} b{batch} K={k}"] = row
        log(f"[eagle3] {shape}: {row}")
        del llm, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def tiny_model(shape: str, layers: int = 2):
    """A small random model for the CPU smoke test (float32)."""
    from specdec.models import LlamaForCausalLM, ModelConfig
    from specdec.models.weights import assign_weights

    cfg = {**hf_config("llama-3.2-1b"), "hidden_size": 64, "intermediate_size": 128}
    cfg.update(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    cfg.update(vocab_size=512)
    config = ModelConfig.from_hf_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)

    def read(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name])
        return torch.empty(shapes[name]).normal_(0.0, 0.5, generator=generator)

    assign_weights(model, read, "random:tiny", torch.float32, "cpu")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="smollm2,oracle")
    parser.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: built-in)")
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--smollm2-batches", default="1,8,32,64")
    parser.add_argument("--head", default=None, help="an EAGLE head directory (default: shipped)")
    parser.add_argument("--oracle-batches", default="1,8")
    parser.add_argument(
        "--smollm2-configs",
        default=None,
        help="comma-separated words: only the smollm2 configurations whose name holds one",
    )
    parser.add_argument("--block-batches", default="1,8")
    parser.add_argument(
        "--block-drafters",
        default=None,
        help="DFLASH_DIR,DSPARK_DIR trained checkpoints (default: started from the target)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    parts = args.parts.split(",")
    if "smollm2" in parts:
        batches = [int(b) for b in args.smollm2_batches.split(",")]
        only = args.smollm2_configs.split(",") if args.smollm2_configs else None
        path = out / "smollm2.json"

        def save(result: dict) -> None:
            path.write_text(json.dumps({"meta": meta, **result}, indent=1))

        save(bench_smollm2(args.gguf, args.device, args.output_len, batches, only, save, args.head))
    if "block" in parts:
        batches = [int(b) for b in args.block_batches.split(",")]
        result = bench_block(
            args.gguf, args.device, args.output_len, batches, args.block_drafters, out / "drafters"
        )
        (out / "block.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    if "oracle" in parts:
        shapes = args.shapes.split(",")
        assert all(s in SHAPES or s == "tiny" for s in shapes), shapes
        batches = [int(b) for b in args.oracle_batches.split(",")]
        result = bench_oracle(shapes, args.device, args.output_len, batches, (0.6, 0.8))
        (out / "oracle.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    if "eagle3" in parts:
        shapes = args.shapes.split(",")
        assert all(s in SHAPES or s == "tiny" for s in shapes), shapes
        result = bench_eagle3(shapes, args.device, args.output_len, out / "drafters")
        (out / "eagle3.json").write_text(json.dumps({"meta": meta, **result}, indent=1))


if __name__ == "__main__":
    main()
