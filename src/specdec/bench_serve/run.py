"""The serving benchmark's levels against a server and its command line (`specdec bench --serve`,
`benchmarks/bench_serve.py`): the load levels with the engine's step counters per level, the
`--no-spec` server's levels, the ceiling, and the report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from specdec.bench_serve import client
from specdec.bench_serve.ceiling import generate_levels
from specdec.bench_serve.client import (
    NO_SPEC_MODE,
    LevelResult,
    print_level,
    read_prompts,
    run_level,
    warm_up,
)
from specdec.bench_serve.report import machine, markdown, plot
from specdec.bench_serve.rules import MIXES
from specdec.bench_serve.server_process import start_server, stop_server
from specdec.cli.flags import DEFAULT_SPECULATIVE_CONFIG

DESCRIPTION = (
    "Drives `specdec serve` at several loads, speculation on vs off (JSON, markdown and a plot)."
)

COUNTER_PREFIXES = (
    "specdec:num_",
    "specdec:spec_k_chosen",
    "specdec:cuda_graphs",
    "specdec:triton_compiles",
    "specdec:stream_outputs_coalesced",
)
# gauges read at the end of each level: the speculation policy's estimates then
POLICY_PREFIXES = ("specdec:spec_policy",)

# what a warmed-up server should not do under traffic
STALL_PREFIXES = ("specdec:cuda_graphs", "specdec:triton_compiles")


def engine_counters(metrics: str, prefixes: tuple[str, ...] = COUNTER_PREFIXES) -> dict[str, float]:
    """The server's `specdec:` step counters (or other metrics of `prefixes`) from its /metrics
    text (labels dropped but bucket, k, kind, kernel and position:
    `specdec:spec_k_chosen_total[k=2]`, `specdec:num_rows_total[kind=prefill]`,
    `specdec:triton_compiles_after_warm_up_total[kernel=...]`,
    `specdec:spec_policy_step_seconds[bucket=8][k=1]`)."""
    counters = {}
    for line in metrics.splitlines():
        if line.startswith(prefixes) and "_created" not in line.split(" ")[0]:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            for label in ("bucket", "k", "kind", "kernel", "position"):
                marker = f'{{{label}="' if f'{{{label}="' in name else f',{label}="'
                if marker in name:
                    key += f"[{label}={name.split(marker)[1].split(chr(34))[0]}]"
            counters[key] = float(value)
    return counters


def level_modes(args: argparse.Namespace) -> tuple[bool, ...]:
    """The levels' modes in order (False: plain requests, True: spec): both, or one with
    --plain-only / --spec-only."""
    if args.plain_only:
        return (False,)
    return (True,) if args.spec_only else (False, True)


def run(
    args: argparse.Namespace, modes: tuple[bool, ...] = (False, True)
) -> tuple[dict, list[LevelResult]]:
    """Every load level of `modes` (False: plain requests, True: spec) against args.url."""
    started = time.perf_counter()
    if args.warmup_requests:
        asyncio.run(warm_up(args, modes))
    levels = []
    print(
        f"{'mode':>14} {'load':>8} {'reqs':>4} {'fail':>4} {'req/s':>6} {'tok/s':>7} "
        f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p99 ms':>15} "
        f"{'acc len':>7} {'s':>5} {'cli':>3}"
    )
    loads = (
        [(args.max_concurrency, rate) for rate in args.request_rate]
        if args.request_rate
        else [(concurrency, None) for concurrency in args.concurrency]
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def metrics_now() -> str:
        return httpx.get(f"{args.url}/metrics", timeout=30.0, headers=headers).text

    # Per level, what its counters grew by (which path served it; graphs and compiles under it),
    # and the speculation policy's estimates at its end
    by_level, policy_by_level = {}, {}
    before = engine_counters(metrics_now())
    for concurrency, rate in loads:
        for spec in modes:
            level = run_level(args, concurrency, spec, rate)
            levels.append(level)
            print_level(level)
            metrics = metrics_now()
            after = engine_counters(metrics)
            policy_by_level[f"{level.mode} {level.label}"] = engine_counters(
                metrics, POLICY_PREFIXES
            )
            grown = {k: v - before.get(k, 0.0) for k, v in after.items()}
            grown = {k: v for k, v in grown.items() if v}
            by_level[f"{level.mode} {level.label}"] = grown
            stalls = {k: v for k, v in grown.items() if k.startswith(STALL_PREFIXES)}
            if stalls:
                print(f"{'':>14} under this level: {stalls}", flush=True)
            before = after
    models = httpx.get(f"{args.url}/v1/models", timeout=30.0, headers=headers).json()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "argv": args.command,
        "url": args.url,
        "model": args.serve or models["data"][0]["id"],
        "max_model_len": models["data"][0].get("max_model_len"),
        "serve_command": getattr(args, "serve_command", None),
        "startup_seconds": getattr(args, "startup_seconds", None),  # process start to /health
        "speculative_config": (args.speculative_config or "the server's default")
        if args.serve is not None
        else None,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "client_processes": args.client_processes or "auto",
        "seed": args.seed,
        "prompts": args.prompts_file or "the built-in chats",
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests_per_level,
        "temperature": args.temperature,
        "rules": args.rules,
        "machine": machine(),
        # which path served the steps, and graphs captured under traffic (0 after a warm-up)
        "engine_counters": before,
        "engine_counters_by_level": by_level,
        "policy_estimates_by_level": policy_by_level,
        "benchmark_s": time.perf_counter() - started,
    }
    return meta, levels


def no_spec_levels(args: argparse.Namespace, levels: list[LevelResult], out_dir: Path) -> dict:
    """The plain levels again against a second server started with `--no-spec` (the baseline a
    user compares with: its plain requests take the overlapped plain loop, where a speculative
    server's plain requests take the synchronous step); appends them to `levels` as mode
    "no-spec server" and returns that server's start-up time and step counters."""
    args.no_spec_now = True
    server = start_server(args, out_dir / "server_no_spec.log")
    try:
        meta, plain = run(args, modes=(False,))
    finally:
        stop_server(server)
        args.no_spec_now = False
    levels += [dataclasses.replace(level, mode=NO_SPEC_MODE) for level in plain]
    return {
        "serve_command": meta["serve_command"],
        "startup_seconds": meta["startup_seconds"],
        "engine_counters": meta["engine_counters"],
        "engine_counters_by_level": meta["engine_counters_by_level"],
    }


class _Parser(argparse.ArgumentParser):
    """Errors in one line, `prog: error: message`, exit status 2 (as `specdec`'s own)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {' '.join(str(message).split())}\n")
        sys.exit(2)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's flags (`specdec bench --serve --help`)."""
    parser = _Parser(prog=prog, description=DESCRIPTION)
    target = parser.add_argument_group("server")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    target.add_argument(
        "--serve",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL",
        help="start `specdec serve MODEL` and use it (no MODEL: the built-in model)",
    )
    target.add_argument(
        "--server-src",
        default=None,
        metavar="DIR",
        help="run the started servers from this specdec source tree, put first on their "
        "PYTHONPATH (a revision that benchmarks/ab_serve.py prepared); the client and "
        "--generate run this one",
    )
    target.add_argument("--device", default="auto", help="--device of the started server")
    target.add_argument("--dtype", default="auto", help="--dtype of the started server")
    target.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of the started server and of --generate (default: serve's own "
        "default), so that the ceiling runs on as many threads as the server's engine",
    )
    target.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help="of the started server (default: the server's own, as `specdec serve` picks it "
        "for the model: the shipped head for the built-in one, "
        f"{json.dumps(DEFAULT_SPECULATIVE_CONFIG)} for others)",
    )
    target.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="a further flag of the started server, e.g. --serve-arg=--max-model-len=1024",
    )
    target.add_argument("--startup-timeout-s", type=float, default=900.0)
    target.add_argument("--model", default="default", help="the served model name requests use")
    target.add_argument("--api-key", default=None)
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    load.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        help="levels of Poisson arrivals at these requests/s instead of --concurrency",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="with --request-rate: most in flight (0: no limit)",
    )
    load.add_argument("--seed", type=int, default=0, help="of the arrival times")
    load.add_argument(
        "--client-processes",
        type=int,
        default=0,
        help="client processes per level (0: one per 16 streams in flight, at most a quarter of "
        "the cores; one Python process reads at most some tens of thousands of events a second)",
    )
    load.add_argument("--prompts-file", default=None, help='a .jsonl of {"prompt": ...}')
    load.add_argument("--requests-per-level", type=int, default=8)
    load.add_argument("--max-tokens", type=int, default=128)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--warmup-requests", type=int, default=4, help="per mode, before the levels (0: none)"
    )
    load.add_argument(
        "--plain-only",
        action="store_true",
        help="plain requests only (a --url server started with --no-spec refuses spec ones)",
    )
    load.add_argument(
        "--spec-only",
        action="store_true",
        help="speculative requests only (a --url server, profiled under the spec level alone)",
    )
    load.add_argument(
        "--no-spec-server",
        action="store_true",
        help="also the plain levels against a second server started with --no-spec (needs "
        "--serve): the spec / --no-spec column",
    )
    load.add_argument(
        "--generate",
        action="store_true",
        help="also LLM.chat on each concurrency level's requests in this process (needs --serve)",
    )
    load.add_argument("--generate-max-model-len", type=int, default=None)
    load.add_argument(
        "--rules",
        choices=MIXES,
        default="none",
        help="mixed: request i asks for log-probabilities, penalties or a JSON schema in turn "
        "(issue 34's mixed traffic; TPOT p50 reported per rule); no-json: log-probabilities "
        "and penalties in turn; penalties: every request; json-heavy: seven in eight with a JSON "
        "schema, the eighth without; none: no rules",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--out-dir", default="bench-results/serve", help="writes serve.json and serve.md here"
    )
    output.add_argument(
        "--out", default=None, help="or: this JSON file, with the .md (and server.log) beside it"
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Runs the benchmark with `argv` (default: this process's arguments); the exit status: 0,
    or 1 when a request failed."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.command = [prog] if prog else [Path(sys.argv[0]).as_posix()]
    args.command += list(sys.argv[1:] if argv is None else argv)
    if args.serve is not None and args.api_key is not None:
        parser.error("--api-key is for --url servers; a started server has none")
    if args.generate and args.serve is None:
        parser.error("--generate needs --serve (the model it loads in this process)")
    if args.no_spec_server and args.serve is None:
        parser.error("--no-spec-server needs --serve (the model its second server loads)")
    if args.plain_only and (args.no_spec_server or args.serve is not None):
        parser.error("--plain-only is for a --url server started with --no-spec")
    if args.spec_only and (args.plain_only or args.serve is not None):
        parser.error("--spec-only is for a --url server, and not with --plain-only")
    if args.generate and args.rules != "none":
        parser.error(f"--generate runs requests without rules: not with --rules {args.rules}")
    if args.request_rate and any(rate <= 0 for rate in args.request_rate):
        parser.error("--request-rate must be > 0")
    if args.prompts_file:
        client.PROMPTS[:] = read_prompts(args.prompts_file)
    if args.threads is None:
        from specdec.cli.flags import default_threads

        args.threads = default_threads()

    out_json = Path(args.out) if args.out else Path(args.out_dir) / "serve.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args, out_json.parent / "server.log") if args.serve is not None else None
    try:
        meta, levels = run(args, modes=level_modes(args))
    finally:
        if server is not None:
            stop_server(server)
    if args.no_spec_server:
        meta["no_spec_server"] = no_spec_levels(args, levels, out_json.parent)
    if args.generate:
        levels += generate_levels(args, meta.setdefault("generate_counters_by_level", {}))
    report = {"meta": meta, "levels": [asdict(x) | {"load": x.label} for x in levels]}
    out_json.write_text(json.dumps(report, indent=2))
    out_json.with_suffix(".md").write_text(markdown(meta, levels))
    plot(levels, out_json.with_suffix(".png"))
    print(f"wrote {out_json}, {out_json.with_suffix('.md')} and {out_json.with_suffix('.png')}")
    return 1 if any(x.num_failed for x in levels) else 0
