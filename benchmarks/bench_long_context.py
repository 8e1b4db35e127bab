"""Long requests on the GPU: a Llama-3-8B-shaped model (random bf16 weights, Llama 3.1 RoPE
scaling, 131,072-token context), one request at a time at each length: prefill, then
`--new-tokens` greedy tokens, speculation off and on (the oracle drafter of `oracle_drafter.py`
replaying the plain run's own continuation with acceptance a, or n-gram over a repetitive prompt).

    PYTHONPATH=src:tests python benchmarks/bench_long_context.py --out DIR \
        [--lengths 32768,65536,131072] [--new-tokens 256] [--drafter oracle|ngram] \
        [--acceptance 0.8] [--k 4] [--prefill-chunk 2048] [--shape llama-3-8b|tiny]

A length L is the request's whole length: the prompt holds L - new_tokens - 3 (K + 1) - 1
tokens, so the request fits a max_model_len of L (131,072 for the largest) with room for the
rounds in flight after its last token. Per length and variant it records:
no error (an exception is recorded with its message, and the next length still runs), the time
to the first token (the prefill), the decode TPOT ((end - first token) / (tokens - 1), after a
warm-up request on the same engine that captures its graphs), that
speculative greedy output equals plain greedy output, spec-decode statistics, and a NaN check
(a separate 2-token request with logprobs: every logprob finite; one more prefill per length,
`--skip-nan-check` leaves it out), and on CUDA the plain TPOT against its floor: every weight
and every cached K/V byte read once at the device-to-device copy bandwidth measured in the same
run (`decode_floor`). Writes DIR/long_context.json.

Memory (8B, bf16): 128 KiB of KV per token, 16 GiB at 131,072 tokens, beside 16 GB of weights;
the KV cache is sized to the longest length (`num_kv_blocks`), not to free memory. Prefill runs
in chunks of `--prefill-chunk` tokens over the cached prefix with whatever attention the engine
has: an attention that materialises scores needs chunk x L x 32 heads x 4 bytes (32 GiB for 2,048
x 131,072): lower `--prefill-chunk` then. `--shape tiny --device cpu` runs the same code on a CPU
in seconds (a smoke test, not a figure). Never imported by tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from oracle_drafter import OracleDrafter

BLOCK_SIZE = 16
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_parameters": LLAMA3_ROPE,
    },
    # The CPU smoke shape: the same code paths, original window 64, context 1,024.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 64},
    },
}
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def log(*args) -> None:
    print(*args, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(shape: str, device: str):
    """Random weights made on `device` (bf16 on CUDA, float32 on the CPU), norms at 1."""
    from specdec.models import LlamaForCausalLM, ModelConfig
    from specdec.models.weights import assign_weights

    config = ModelConfig.from_hf_config({**COMMON, **SHAPES[shape]})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    std = 0.02 if shape != "tiny" else 0.5

    def read(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=dtype, device=device)
        out = torch.empty(shapes[name], dtype=dtype, device=device)
        return out.normal_(0.0, std, generator=generator)

    assign_weights(model, read, f"random:{shape}", dtype, device)
    return model


def make_llm(model, spec, *, device: str, max_model_len: int, prefill_chunk: int):
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm import LLM
    from specdec.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=1,
        max_model_len=max_model_len,
        max_num_batched_tokens=prefill_chunk,
        num_kv_blocks=math.ceil(max_model_len / BLOCK_SIZE) + 8,
        block_size=BLOCK_SIZE,
        async_scheduling=True,
    )
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(config, SpeculativeConfig.from_dict(spec), model=model, tokenizer=None)
    return llm


def long_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """A 512-token random stretch repeated to `length` tokens (n-gram finds matches in it)."""
    generator = torch.Generator().manual_seed(seed)
    stretch = torch.randint(3, vocab, (512,), generator=generator).tolist()
    return (stretch * (length // 512 + 1))[:length]


def timed_generate(
    llm, prompt, new_tokens: int, device: str, speculative=None, profile: Path | None = None
) -> dict:
    """One greedy request: time to the first token, decode TPOT, the tokens. With `profile`,
    the decode part (from the first token on) runs under the PyTorch profiler (its TPOT then
    includes the profiler's overhead) and the kernels' device time is written there."""
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    first: list[float] = []
    profiler = None
    if profile is not None:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def on_tokens(output) -> None:
        if not first and output.outputs[0].token_ids:
            first.append(time.perf_counter())
            if profiler is not None:
                profiler.start()

    sync(device)
    start = time.perf_counter()
    out = llm.generate(
        [prompt], params, speculative=speculative, use_tqdm=False, on_tokens=on_tokens
    )[0]
    sync(device)
    end = time.perf_counter()
    if profiler is not None and first:
        profiler.stop()
        table = profiler.key_averages().table(sort_by="self_device_time_total", row_limit=40)
        profile.write_text(f"decode of {new_tokens} tokens after the first\n{table}\n")
    tokens = list(out.outputs[0].token_ids)
    first_s = (first[0] if first else end) - start
    return {
        "prefill_s": first_s,
        "decode_tpot_ms": (end - start - first_s) / max(len(tokens) - 1, 1) * 1e3,
        "total_s": end - start,
        "num_tokens": len(tokens),
        "tokens": tokens,
        "spec_decode_stats": out.spec_decode_stats,
    }


def warm_up(llm, vocab: int, device: str, max_model_len: int) -> None:
    """A short request past the split-KV threshold where the length allows (a fresh engine
    captures its decode graphs, or its round graphs, on first use: outside the timed request).
    With the oracle drafter installed, its unknown context drafts nothing useful: the rounds
    still run and capture."""
    from specdec.models.attention_tiles import SPLIT_KV_PARTITION
    from specdec.sampling import SamplingParams

    prompt = long_prompt(min(SPLIT_KV_PARTITION + 64, max_model_len - 32), vocab, seed=1)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    sync(device)


def nan_check(llm, prompt) -> dict:
    """A 2-token request with logprobs (the synchronous path): are its logprobs finite?"""
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params, speculative={"enabled": False}, use_tqdm=False)[0]
    values = [lp.logprob for step in out.outputs[0].logprobs for lp in step.values()]
    return {"finite": all(math.isfinite(v) for v in values), "logprobs": values}


def near_tie(model, prompt, plain_tokens, spec_tokens, at: int, common: dict) -> dict:
    """Where greedy speculative and plain outputs first differ: the plain logprobs (synchronous
    path, top 5) of both tokens there. A gap of the order of bf16 rounding is a near-tie between
    the verify step's and the decode step's arithmetic, not a wrong acceptance."""
    from specdec.sampling import SamplingParams

    llm = make_llm(model, None, **common)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
        out = llm.generate([prompt + plain_tokens[:at]], params, use_tqdm=False)[0]
        top = out.outputs[0].logprobs[0]
        ranked = sorted(top.items(), key=lambda item: -item[1].logprob)
        values = {token: lp.logprob for token, lp in ranked}
        plain_lp = values.get(plain_tokens[at])
        spec_lp = values.get(spec_tokens[at])
        return {
            "top5": [[token, lp] for token, lp in values.items()],
            "plain_token": plain_tokens[at],
            "spec_token": spec_tokens[at],
            "gap": None if plain_lp is None or spec_lp is None else plain_lp - spec_lp,
        }
    finally:
        del llm
        free(common["device"])


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: str, gigabytes: float = 4.0) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write counted once each, as the
    decode floor counts bytes read), median of 5 copies of `gigabytes` GB; None off CUDA."""
    if device != "cuda":
        return None
    count = int(gigabytes * 1e9) // 2
    src = torch.empty(count, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    free(device)
    return 2 * count * 2 / sorted(times)[2]


def decode_floor_ms(model, context_tokens: int, bandwidth: float | None) -> dict | None:
    """A decode step's floor: every weight and every cached K/V byte of the context read once,
    at the copy bandwidth measured in this run."""
    if bandwidth is None:
        return None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    kv_per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        * torch.finfo(model.dtype).bits // 8
    )  # fmt: skip
    kv_bytes = kv_per_token * context_tokens
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3,
    }


def bench_length(model, length: int, args) -> dict:
    k, new = args.k, args.new_tokens
    # Room for two rounds in flight past the last token: the request never reaches the
    # length limit, where the synchronous step's smaller K would compile new Triton variants.
    prompt_len = length - new - 3 * (k + 1) - 1
    vocab = model.config.vocab_size
    prompt = long_prompt(prompt_len, vocab, seed=length)
    row: dict = {"length": length, "prompt_tokens": prompt_len, "new_tokens": new}
    common = {"device": args.device, "max_model_len": length, "prefill_chunk": args.prefill_chunk}
    llm = make_llm(model, None, **common)
    try:
        warm_up(llm, vocab, args.device, length)
        plain = timed_generate(llm, prompt, new, args.device)
        row["plain"] = {key: v for key, v in plain.items() if key != "tokens"}
        if not args.skip_nan_check:
            row["nan_check"] = nan_check(llm, prompt)
    except Exception as err:  # recorded: the next length still runs
        row["plain"] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
        return row
    finally:
        del llm
        free(args.device)
    floor = decode_floor_ms(model, prompt_len + new // 2, args.bandwidth)
    if floor is not None:
        floor["plain_tpot_over_floor"] = plain["decode_tpot_ms"] / floor["floor_ms"]
        row["decode_floor"] = floor
    log(f"[long] {length} plain: {row['plain']} floor: {floor}")
    row["drafters"] = {}
    for drafter in args.drafters:
        row["drafters"][drafter] = bench_drafter(model, drafter, prompt, plain, common, args)
        log(f"[long] {length} {drafter}: {row['drafters'][drafter]}")
    first = row["drafters"][args.drafters[0]]  # the table's "spec" columns
    row["spec"] = first.get("spec")
    row["spec_equals_plain"] = all(d.get("spec_equals_plain") for d in row["drafters"].values())
    return row


def drafter_config(model, drafter: str, k: int) -> dict:
    """The speculative config of a drafter with its own state: a random EAGLE head (its paged
    one-layer KV grows with the request) or a block drafter started from the target's weights
    (its context: every drafter layer's K/V of the request's positions). n-gram and the oracle
    keep no KV of their own. Acceptance means little for these weights; their rounds' cost and
    exactness at the length are what is measured."""
    if drafter in ("oracle", "ngram"):
        return {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
    root = Path(tempfile.mkdtemp(prefix=f"long-{drafter}-"))
    if drafter == "eagle":
        from probes.probe_spec_step import random_eagle_head

        vocab = model.config.vocab_size
        path = random_eagle_head(model, root / "head", draft_vocab=min(16384, vocab // 2))
    else:
        from bench_spec_round import block_drafter_dirs

        path = block_drafter_dirs(model, None, root)[drafter]
    return {"method": drafter, "model": path, "num_speculative_tokens": k, "adaptive": False}


def bench_drafter(model, drafter: str, prompt, plain: dict, common: dict, args) -> dict:
    """One drafter at one length: the same greedy request as plain, its TPOT, and whether its
    output equals plain greedy output (else where they split and by what margin)."""
    out: dict = {}
    vocab = model.config.vocab_size
    llm = None
    try:
        llm = make_llm(model, drafter_config(model, drafter, args.k), **common)
        if drafter == "oracle":
            llm.engine.drafter = OracleDrafter(
                vocab, args.acceptance, [prompt + plain["tokens"]], key_len=64
            )
        warm_up(llm, vocab, args.device, common["max_model_len"])
        profile = None
        if args.profile_decode:
            profile = Path(args.out) / f"profile_{common['max_model_len']}_{drafter}.txt"
        drafted = timed_generate(llm, prompt, args.new_tokens, args.device, profile=profile)
        out["spec"] = {key: v for key, v in drafted.items() if key != "tokens"}
        out["spec"]["profiled"] = profile is not None
        out["spec"]["loop"] = llm.get_metrics().get("loop")
        out["spec_over_plain_tpot"] = drafted["decode_tpot_ms"] / plain["decode_tpot_ms"]
        out["spec_equals_plain"] = drafted["tokens"] == plain["tokens"]
        if not out["spec_equals_plain"]:
            at = next(
                i
                for i, (a, b) in enumerate(zip(drafted["tokens"], plain["tokens"], strict=False))
                if a != b
            )
            out["first_mismatch_at"] = at
            out["mismatch_margin"] = near_tie(
                model, prompt, plain["tokens"], drafted["tokens"], at, common
            )
    except Exception as err:
        out["spec"] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
    finally:
        del llm
        free(args.device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="32768,65536,131072")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--drafter",
        default="oracle",
        help="comma list of oracle, ngram, eagle, dflash, dspark (each beside one plain run)",
    )
    parser.add_argument("--acceptance", type=float, default=0.8, help="the oracle's a")
    parser.add_argument("--k", type=int, default=4, help="drafts per round (pinned)")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument(
        "--skip-nan-check", action="store_true", help="no third prefill per length (the check)"
    )
    parser.add_argument(
        "--profile-decode",
        action="store_true",
        help="each drafter's decode under the PyTorch profiler (DIR/profile_<L>_<drafter>.txt; "
        "its TPOT then includes the profiler's overhead)",
    )
    args = parser.parse_args()
    args.drafters = args.drafter.split(",")
    unknown = set(args.drafters) - {"oracle", "ngram", "eagle", "dflash", "dspark"}
    if unknown:
        parser.error(f"unknown drafters {sorted(unknown)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    context = SHAPES[args.shape]["max_position_embeddings"]
    too_long = [n for n in lengths if n > context]
    if too_long:
        parser.error(f"lengths {too_long} exceed the {args.shape} context of {context}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = build_model(args.shape, args.device)
    args.bandwidth = copy_bandwidth(args.device)
    rows = [bench_length(model, length, args) for length in lengths]
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "shape": args.shape,
            "drafter": args.drafter,
            "acceptance": args.acceptance if "oracle" in args.drafters else None,
            "k": args.k,
            "prefill_chunk": args.prefill_chunk,
            "copy_bandwidth_gb_s": None if args.bandwidth is None else args.bandwidth / 1e9,
            "seconds": time.perf_counter() - start,
        },
        "results": rows,
        "all_ok": all(
            r.get("spec_equals_plain")
            and (args.skip_nan_check or r.get("nan_check", {}).get("finite"))
            for r in rows
        ),
    }
    path = out / "long_context.json"
    path.write_text(json.dumps(result, indent=2))
    log(f"all_ok={result['all_ok']}; wrote {path}")


if __name__ == "__main__":
    main()
