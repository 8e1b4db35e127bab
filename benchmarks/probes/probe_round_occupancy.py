"""How many of the running requests the device rounds carry while requests keep arriving, and how
long an arrival takes to reach a slot, counted in engine steps (issue 34: at c = 16 the rounds
carried about 12 of 16 requests, s44, H100). Cycle logic, not speed: it runs anywhere.

A tiny Llama (tests' fixtures, random weights) with a briefly trained EAGLE head, or with `--gguf`
the built-in model's GGUF and its shipped head on held-out chats; device rounds (op by op on the
CPU), K pinned; `--concurrency` requests (40-token prompts, or chats) kept in flight
through `--max-num-seqs` slots (each finished request replaced at once). Per `engine.step` call
in the rounds: the rows the round carries, the requests running, those joining (admitted, in
prefill or waiting for a seat) and those waiting for admission. Per request: the steps from its
arrival to its first round. `MAX_ADMISSION_WAIT_S` is time-based; `--max-wait-steps` sets it to
that many of this machine's measured steps, so that the gathering behaves as on a device whose
steps take as long relative to it.

    PYTHONPATH=src:tests:benchmarks python3 benchmarks/probes/probe_round_occupancy.py \
        --out DIR [--concurrency 16] [--admission-share 8] [--device cpu] [--gguf GGUF --k 4]

Writes DIR/round_occupancy.json (a profile, not a figure).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--admission-share", default="8", help="comma-separated values to run")
    parser.add_argument("--max-wait-steps", type=float, default=25.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gguf", default=None, help="the built-in model's GGUF and its head")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts-file", default="benchmarks/data/heldout_prompts.jsonl")
    args = parser.parse_args()

    from eagle_fixtures import trained_head
    from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
    from specdec.engine import overlapped_loop
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.sampling import SamplingParams

    if args.gguf is None:
        root = Path(tempfile.mkdtemp())
        model = str(save_hf_model(make_hf_model("llama"), root / "model"))
        head_dir = trained_head(model, root / "head")
        prompts = prompt_tokens(97, [40] * args.requests, seed=5)
    else:
        from specdec.bench_serve.client import read_prompts
        from specdec.drafters.default import DEFAULT_EAGLE_DIR

        model, head_dir = args.gguf, DEFAULT_EAGLE_DIR
        texts = read_prompts(args.prompts_file)
        prompts = []  # tokenized by the first engine
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": args.k}
    spec["adaptive"] = False

    def run(share: int, wait_s: float) -> dict:
        overlapped_loop.ADMISSION_BATCH_SHARE = share
        overlapped_loop.MAX_ADMISSION_WAIT_S = wait_s
        config = EngineConfig(
            model=model,
            max_model_len=1024,
            block_size=4,
            max_num_seqs=args.max_num_seqs,
            async_scheduling=True,
            device=args.device,
        )
        engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
        if not prompts:
            chats = [
                [{"role": "user", "content": texts[i % len(texts)]}] for i in range(args.requests)
            ]
            prompts.extend(engine.tokenizer.encode_chat(chat) for chat in chats)
        arrived: dict[str, int] = {}
        first_round: dict[str, int] = {}
        samples = []  # (rows in the round, running, joining, waiting)
        issued = steps = 0

        def add() -> None:
            nonlocal issued
            params = SamplingParams(
                max_tokens=args.max_tokens, temperature=0.8, seed=issued, ignore_eos=True
            )
            arrived[engine.add_request(prompts[issued], params)] = steps
            issued += 1

        start = time.perf_counter()
        for _ in range(min(args.concurrency, len(prompts))):
            add()
        while engine.has_unfinished:
            outputs = engine.step(only_finished=True)
            steps += 1
            rounds = engine._rounds
            if engine._in_rounds and rounds is not None:
                live = [r for r in rounds.live_requests if not r.status.finished]
                for request in live:  # (its sample's id: "<request id>#<index>")
                    first_round.setdefault(request.request_id.rsplit("#", 1)[0], steps)
                samples.append(
                    (
                        len(live),
                        len(engine.scheduler.running),
                        len(engine._round_joiners),
                        len(engine.scheduler.waiting),
                    )
                )
            for output in outputs:
                if output.finished and issued < len(prompts):
                    add()
        seconds = time.perf_counter() - start
        # Arrivals after the start (replacing a finished request): steps to their first round.
        late = [first_round[r] - s for r, s in arrived.items() if s > 0 and r in first_round]
        carried = [rows / running for rows, running, _, _ in samples if running]
        return {
            "admission_share": share,
            "max_wait_s": wait_s,
            "seconds": round(seconds, 2),
            "steps": steps,
            "round_steps": len(samples),
            "carried_share_mean": round(statistics.fmean(carried), 3) if carried else None,
            "rows_mean": round(statistics.fmean(s[0] for s in samples), 2) if samples else None,
            "joining_mean": round(statistics.fmean(s[2] for s in samples), 2) if samples else None,
            "waiting_mean": round(statistics.fmean(s[3] for s in samples), 2) if samples else None,
            "steps_to_first_round": dict(sorted(collections.Counter(late).items())),
            "steps_to_first_round_mean": round(statistics.fmean(late), 2) if late else None,
            "counters": {
                "device_rounds": engine.loop_stats.num_device_rounds,
                "round_joins": engine.loop_stats.num_round_joins,
                "overlapped_steps": engine.loop_stats.num_overlapped_steps,
            },
        }

    # One run to measure this machine's step (the wait in steps needs it), then each share.
    probe = run(8, 1e9)
    step_s = probe["seconds"] / max(probe["steps"], 1)
    wait_s = args.max_wait_steps * step_s
    result = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)},
        "step_s": round(step_s, 5),
        "runs": [run(int(share), wait_s) for share in args.admission_share.split(",")],
    }
    for entry in result["runs"]:
        print(json.dumps(entry), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "round_occupancy.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'round_occupancy.json'}")


if __name__ == "__main__":
    main()
