"""Where the speculating engine spends its time when requests keep arriving, against plain (issue
34: the server at c = 16 runs at 1.07-1.11x of `--no-spec` while its policy's own round costs
promise about 1.7x; s42, s43, H100).

In one process, without HTTP: an engine of `--max-num-seqs` slots (the server's 64) is kept at
`--concurrency` requests in flight — each finished request is replaced by the next at once, as
the bench's closed-loop clients do — over `--requests` held-out chats (128 tokens, T = 0.8, EOS
ignored), with the default speculation and without (both warmed up as `specdec serve` warms
up). Per run: seconds, output tokens/s, the loop counters grown, the K chosen, the policy's
estimates. Then, on the speculative engine, two more runs with the engine's parts timed: host
clocks alone (what the engine's process spends in each part, the device left to overlap), and
with `torch.cuda.synchronize()` around each part (its device work too; the synchronisation
slows the run: a profile, not a figure). `--admission-share` runs the speculative engine again
with other values of `ADMISSION_BATCH_SHARE` (gathering more arrivals per join).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_joining_rounds.py --gguf GGUF \
        --out DIR [--concurrency 16] [--requests 384] [--admission-share 4,2]

Writes DIR/joining_rounds.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specdec.bench_serve.client import read_prompts  # noqa: E402


def wrapper(synchronise: bool, totals: dict, counts: collections.Counter, undo: list):
    """A function that wraps `owner.name` with a host clock under `label` (synchronised around
    each call when `synchronise`), recording the original in `undo`."""

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if synchronise:
                synchronize()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if synchronise:
                    synchronize()
                totals[label] += time.perf_counter() - start
                counts[label] += 1

        setattr(owner, name, timed)
        undo.append((owner, name, inner))

    return wrap


def timed_parts(synchronise: bool):
    """Wraps the engine's parts with host clocks (synchronised around each call when
    `synchronise`); returns (totals, counts, restore). Nested parts count in both."""
    from specdec.engine import device_round, llm_engine, overlapped_loop, speculative_loops

    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    undo: list = []
    wrap = wrapper(synchronise, totals, counts, undo)

    loops = speculative_loops.SpeculativeLoops
    wrap(llm_engine.LLMEngine, "step", "engine.step")
    wrap(loops, "_step_rounds", "rounds loop")
    wrap(loops, "_launch_joining_prefill", "launch joining step")
    wrap(loops, "_seat_joiners", "seat joiners")
    wrap(loops, "_enter_rounds", "enter rounds")
    wrap(loops, "_leave_rounds", "leave rounds")
    wrap(overlapped_loop.OverlappedLoop, "_step_overlapped", "overlapped loop")
    wrap(overlapped_loop.OverlappedLoop, "_read_commits", "read a plain/joining step")
    wrap(llm_engine.LLMEngine, "_commit", "commit")
    for name in ("launch", "read", "admit"):
        wrap(device_round.DeviceRounds, name, f"rounds.{name}")

    def restore():
        for owner, name, inner in reversed(undo):
            setattr(owner, name, inner)

    return totals, counts, restore


def drive(llm, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Keeps `concurrency` requests in flight until every prompt ran; returns the seconds."""
    from specdec import SamplingParams

    engine = llm.engine
    issued = 0

    def add() -> None:
        nonlocal issued
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=issued, ignore_eos=True
        )
        engine.add_request(prompts[issued], params)
        issued += 1

    start = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        add()
    while engine.has_unfinished:
        for output in engine.step(only_finished=True):
            if output.finished and issued < len(prompts):
                add()
    synchronize()
    return time.perf_counter() - start


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def policy_estimates(llm) -> dict:
    policy = llm.engine.policy
    if policy is None:
        return {}
    costs = {f"b{b} k{k}": [round(s * 1e3, 3), n] for (b, k), (s, n) in policy.costs().items()}
    acceptance = [round(policy.acceptance(i), 3) for i in range(policy.max_k)]
    return {"costs_ms": costs, "acceptance": acceptance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts-file", default="benchmarks/data/heldout_prompts.jsonl")
    parser.add_argument("--admission-share", default="", help="e.g. 16,2 (default: none)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from specdec import LLM
    from specdec.engine import overlapped_loop

    texts = read_prompts(args.prompts_file)
    result: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        }
    }
    tokens = args.requests * args.max_tokens

    def run(llm, label: str) -> dict:
        before = llm.get_metrics()["loop"]
        seconds = drive(llm, prompts, args.concurrency, args.max_tokens)
        loop = llm.get_metrics()["loop"]
        grown = {
            k: v - before.get(k, 0)
            for k, v in loop.items()
            if isinstance(v, int) and v - before.get(k, 0)
        }
        chosen = {
            k: v - before.get("k_chosen", {}).get(k, 0) for k, v in loop.get("k_chosen", {}).items()
        }
        entry = {"s": round(seconds, 3), "tok_s": round(tokens / seconds), "counters": grown}
        entry["k_chosen"] = chosen
        print(f"[joining] {label}: {json.dumps(entry)}", flush=True)
        return entry

    for spec in ("auto", None):
        mode = "spec" if spec else "plain"
        llm = LLM(
            model=args.gguf,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            speculative_config=spec,
        )
        llm.engine.warm_up(progress=False)
        tokenizer = llm.tokenizer
        prompts = [
            tokenizer.encode_chat([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(args.requests)
        ]
        drive(llm, prompts[: 2 * args.concurrency], args.concurrency, 16)  # settle
        entry = {"runs": [run(llm, f"{mode} run {i}") for i in range(2)]}
        if spec:
            entry["policy"] = policy_estimates(llm)
            for synchronise in (False, True):
                totals, counts, restore = timed_parts(synchronise)
                try:
                    seconds = drive(llm, prompts, args.concurrency, args.max_tokens)
                finally:
                    restore()
                label = "parts_synchronised" if synchronise else "parts_host"
                entry[label] = {
                    "run_s": round(seconds, 3),
                    **{
                        k: [n, round(totals[k] * 1e3, 1), round(totals[k] / n * 1e6)]
                        for k, n in sorted(counts.items())
                    },
                }
                print(f"[joining] spec, {label} ({seconds:.2f} s): calls, ms, us a call")
                for k in sorted(totals):
                    print(f"   {k:>26}: {entry[label][k]}")
            original = overlapped_loop.ADMISSION_BATCH_SHARE
            for share in [int(s) for s in args.admission_share.split(",") if s]:
                overlapped_loop.ADMISSION_BATCH_SHARE = share
                try:
                    entry[f"admission_share_{share}"] = run(llm, f"spec share {share}")
                finally:
                    overlapped_loop.ADMISSION_BATCH_SHARE = original
        result[mode] = entry
        llm.close()
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    spec_tok = statistics.mean([r["tok_s"] for r in result["spec"]["runs"]])
    plain_tok = statistics.mean([r["tok_s"] for r in result["plain"]["runs"]])
    result["spec_over_plain"] = round(spec_tok / plain_tok, 3)
    print(f"[joining] spec / plain: {result['spec_over_plain']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "joining_rounds.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
