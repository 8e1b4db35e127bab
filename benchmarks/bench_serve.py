"""Drives `specdec serve` at several loads, speculation on vs off (JSON, markdown and a plot).

With `--serve MODEL` the script starts `specdec serve MODEL` itself on a free loopback port
(engine flags: --device, --dtype, --speculative-config, and any --serve-arg), waits for /health,
warms it up, runs the levels, and stops it; its log goes to OUT_DIR/server.log. Without it,
`--url` names a server that is already running.

Each level sends `--requests-per-level` (at least the concurrency) streaming chat requests with
ignore_eos and fixed seeds (greedy unless --temperature): with `--concurrency C` in flight at
once, or with `--request-rate R` arriving as a Poisson process of R requests/s (seeded by
`--seed`; at most `--max-concurrency` in flight). It measures requests/s, output tokens/s, and
TTFT, TPOT and ITL (the gaps between streamed chunks) percentiles; "spec" requests ask
`speculative: {"enabled": true}` (the server's --speculative-config), "plain" ones
`{"enabled": false}`, on the same server. The prompts: the built-in chats, or `--prompts-file`
(a .jsonl of {"prompt": ...}: benchmarks/data/heldout_prompts.jsonl, 16 short held-out chats, or
benchmarks/data/long_prompts.jsonl, 32 prompts of about 1,300 tokens from `make_long_prompts.py`).

With `--generate` (and `--serve`), after the server has stopped the same requests run through
`LLM.chat` in this process, a closed batch per concurrency level (max_num_seqs = the
concurrency, at most the server's), spec and plain: the engine's ceiling, beside the server's
figures.

With `--rules mixed` the requests ask in turn for log-probabilities, penalties or a JSON schema
(`serve_rules.py`; TPOT p50 per rule in the report): run it beside `--rules none` (the default)
to see what the rules cost with and without speculation.

    python benchmarks/make_checkpoint.py llama-3.2-1b --out /tmp/llama-3.2-1b --device cuda
    python benchmarks/bench_serve.py --serve /tmp/llama-3.2-1b --device cuda --dtype bfloat16 \\
        --requests-per-level 8 --max-tokens 128 --out-dir bench-results/serve-h200
    # against a running server:
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --out-dir bench-results/serve-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import itertools
import json
import multiprocessing
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from serve_rules import MIXES, RULES, may_end_early, rule_of
from specdec.bench import DEFAULT_PROMPTS
from specdec.cli import DEFAULT_SPECULATIVE_CONFIG

REQUEST_TIMEOUT_S = 600.0
# The mode of the plain levels run against a second server started with --no-spec.
NO_SPEC_MODE = "no-spec server"
# Streams in flight per client process by default (`client_processes`), and the head start the
# processes get to be ready before the level's clock starts.
CLIENT_STREAMS_PER_PROCESS = 16
CLIENT_START_S = 1.0
# Warm-up requests are short: they only have to run every code path (and compile its kernels) once.
WARMUP_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class RequestResult:
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    accepted_tokens: int
    drafts: int
    itl_s: tuple[float, ...] = ()  # gaps between successive streamed chunks after the first
    rule: str = "none"  # what else it asked for (`serve_rules`)


@dataclass(frozen=True, slots=True)
class LevelResult:
    mode: str
    concurrency: int  # the most in flight (0: no limit)
    request_rate: float | None  # Poisson arrivals a second (None: all at once, gated)
    num_requests: int
    num_failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    mean_acceptance_length: float
    tpot_p50_ms_by_rule: dict[str, float] = field(default_factory=dict)  # with --rules mixed
    client_processes: int = 1  # the client processes that drove it (`client_processes`)

    @property
    def label(self) -> str:
        """The level's load: c=N or r=R/s."""
        return (
            f"c={self.concurrency}" if self.request_rate is None else f"r={self.request_rate:g}/s"
        )


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    prompt: str,
    seed: int,
    max_tokens: int,
    spec: bool,
    rule: str = "none",
) -> RequestResult:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": {"enabled": spec},
        **RULES.get(rule, {}),
    }
    started = time.perf_counter()
    first = None
    chunks: list[float] = []
    usage, stats = {}, {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if any(c["delta"].get("content") for c in chunk["choices"]):
                chunks.append(time.perf_counter())
                first = chunks[0]
            if chunk.get("usage"):
                usage = chunk["usage"]
                stats = chunk.get("spec_decode_stats") or {}
    done = time.perf_counter()
    first = first if first is not None else done
    tokens = usage.get("completion_tokens", 0)
    if tokens != max_tokens and not (may_end_early(rule) and 0 < tokens < max_tokens):
        raise RuntimeError(f"expected {max_tokens} output tokens, got {tokens}")
    return RequestResult(
        ttft_s=first - started,
        tpot_s=(done - first) / (tokens - 1) if tokens > 1 else None,
        latency_s=done - started,
        output_tokens=tokens,
        accepted_tokens=stats.get("num_accepted_tokens", 0),
        drafts=stats.get("num_drafts", 0),
        itl_s=tuple(b - a for a, b in itertools.pairwise(chunks)),
        rule=rule,
    )


PROMPTS: list[str] = list(DEFAULT_PROMPTS)  # `--prompts-file` replaces them


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


def read_prompts(path: str) -> list[str]:
    """The "prompt" of each line of a .jsonl file."""
    prompts = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line]
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def arrival_times(rate: float, count: int, seed: int) -> list[float]:
    """Seconds after the start at which `count` requests arrive as a Poisson process of `rate`
    a second (seeded: the same load for every mode)."""
    draws = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += draws.expovariate(rate)
        times.append(now)
    return times


def _client(args: argparse.Namespace, concurrency: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(
        base_url=args.url,
        timeout=REQUEST_TIMEOUT_S,
        limits=httpx.Limits(max_connections=concurrency),
        headers=headers,
    )


async def warm_up(args: argparse.Namespace, modes: tuple[bool, ...] = (False, True)) -> None:
    """A few short requests of each mode, so that no level pays for first-use compilation."""
    count = args.warmup_requests
    async with _client(args, max(count, 1)) as http:
        for spec in modes:
            await asyncio.gather(
                *[
                    one_request(http, args, prompt(i), i, WARMUP_MAX_TOKENS, spec)
                    for i in range(count)
                ]
            )


def client_processes(args: argparse.Namespace, concurrency: int, num_requests: int) -> int:
    """How many client processes drive a level: `--client-processes`, or by default one per
    CLIENT_STREAMS_PER_PROCESS streams in flight, at most a quarter of this machine's cores (one
    Python process reads about 20-50k SSE events a second: s30's c = 64 / 256 levels read tokens
    back to back, ITL p50 0.0 ms, a client behind the server)."""
    if args.client_processes:
        return min(args.client_processes, num_requests)
    streams = concurrency or num_requests
    cap = max(1, (os.cpu_count() or 1) // 4)
    return max(1, min(cap, -(-streams // CLIENT_STREAMS_PER_PROCESS)))


async def drive(
    args: argparse.Namespace,
    indices: list[int],
    arrivals: list[float],
    limit: int,
    spec: bool,
    start_at: float,
) -> tuple[list[RequestResult | str], float]:
    """Sends requests `indices` (request i at `arrivals[i]` seconds after the wall-clock
    `start_at`), at most `limit` in flight (0: no limit). Returns each request's result (or its
    failure, as text) and the wall-clock time the last one ended."""
    gate = asyncio.Semaphore(limit or len(indices))
    async with _client(args, limit or len(indices)) as http:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        started = time.perf_counter()

        async def gated(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, started + arrivals[i] - time.perf_counter()))
            async with gate:
                rule = rule_of(i, args.rules)
                return await one_request(http, args, prompt(i), i, args.max_tokens, spec, rule)

        outcomes = await asyncio.gather(*[gated(i) for i in indices], return_exceptions=True)
    ended = time.time()
    return [r if isinstance(r, RequestResult) else repr(r) for r in outcomes], ended


def _drive_in_process(*args) -> tuple[list[RequestResult | str], float]:
    """`drive(*args)` in a client process of its own (`run_level`)."""
    return asyncio.run(drive(*args))


def run_level(
    args: argparse.Namespace, concurrency: int, spec: bool, rate: float | None = None
) -> LevelResult:
    """One level: `concurrency` requests in flight at once (0: no limit), all queued at the
    start, or arriving at `rate` a second (Poisson). Several client processes share the level
    (`client_processes`): request i goes to process i mod N, and each keeps its share of the
    concurrency in flight; they start together on the wall clock."""
    num_requests = max(concurrency, args.requests_per_level)
    arrivals = arrival_times(rate, num_requests, args.seed) if rate else [0.0] * num_requests
    processes = client_processes(args, concurrency, num_requests)
    shares = [list(range(num_requests))[w::processes] for w in range(processes)]
    limits = [concurrency // processes + (w < concurrency % processes) for w in range(processes)]
    start_at = time.time() + (CLIENT_START_S if processes > 1 else 0.0)
    if processes == 1:
        parts = [_drive_in_process(args, shares[0], arrivals, concurrency, spec, start_at)]
    else:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(processes, mp_context=context) as pool:
            futures = [
                pool.submit(_drive_in_process, args, share, arrivals, limit, spec, start_at)
                for share, limit in zip(shares, limits, strict=True)
            ]
            parts = [future.result() for future in futures]
    outcomes = [outcome for part, _ in parts for outcome in part]
    duration = max(ended for _, ended in parts) - start_at
    results = [r for r in outcomes if isinstance(r, RequestResult)]
    failures = [r for r in outcomes if not isinstance(r, RequestResult)]
    if failures:
        print(f"  {len(failures)} requests failed; first: {failures[0]}", file=sys.stderr)
    ttft = [r.ttft_s * 1e3 for r in results]
    tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    itl = [gap * 1e3 for r in results for gap in r.itl_s]
    drafts = sum(r.drafts for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    return LevelResult(
        mode="spec" if spec else "plain",
        concurrency=concurrency,
        request_rate=rate,
        num_requests=num_requests,
        num_failed=len(failures),
        duration_s=duration,
        requests_per_s=len(results) / duration,
        output_tokens_per_s=sum(r.output_tokens for r in results) / duration,
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p90_ms=percentile(ttft, 0.9),
        ttft_p99_ms=percentile(ttft, 0.99),
        tpot_p50_ms=percentile(tpot, 0.5),
        tpot_p90_ms=percentile(tpot, 0.9),
        tpot_p99_ms=percentile(tpot, 0.99),
        itl_p50_ms=percentile(itl, 0.5),
        itl_p90_ms=percentile(itl, 0.9),
        itl_p99_ms=percentile(itl, 0.99),
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
        client_processes=processes,
        tpot_p50_ms_by_rule={
            rule: percentile([r.tpot_s * 1e3 for r in results if r.rule == rule and r.tpot_s], 0.5)
            for rule in sorted({r.rule for r in results})
        }
        if args.rules != "none"
        else {},
    )


# ------------------------------------------------------- the engine's ceiling
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
                model=args.serve,
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


def print_level(level: LevelResult) -> None:
    ttft = f"{level.ttft_p50_ms:.0f}/{level.ttft_p90_ms:.0f}/{level.ttft_p99_ms:.0f}"
    tpot = f"{level.tpot_p50_ms:.1f}/{level.tpot_p90_ms:.1f}/{level.tpot_p99_ms:.1f}"
    itl = f"{level.itl_p50_ms:.1f}/{level.itl_p99_ms:.1f}"
    print(
        f"{level.mode:>14} {level.label:>8} {level.num_requests:>4} {level.num_failed:>4} "
        f"{level.requests_per_s:>6.2f} {level.output_tokens_per_s:>7.1f} {ttft:>22} "
        f"{tpot:>22} {itl:>15} {level.mean_acceptance_length:>7.2f} {level.duration_s:>5.1f} "
        f"{level.client_processes:>3}",
        flush=True,
    )


# --------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        args.serve,
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        *(
            ["--no-spec"]
            if getattr(args, "no_spec_now", False)
            else ["--speculative-config", json.dumps(args.speculative_config)]
            if args.speculative_config is not None
            else []  # the server's own default
        ),
        *args.serve_arg,
    ]


def start_server(args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    """Starts `specdec serve` and waits until /health answers (or the process dies)."""
    port = free_port()
    args.url = f"http://127.0.0.1:{port}"
    command = serve_command(args, port)
    args.serve_command = command
    print("starting:", " ".join(command), flush=True)
    log = log_path.open("wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    started = time.monotonic()
    deadline = started + args.startup_timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"specdec serve exited with {server.returncode}:\n{tail}")
        try:
            if httpx.get(f"{args.url}/health", timeout=2.0).status_code == 200:
                args.startup_seconds = round(time.monotonic() - started, 1)
                print(f"ready: /health answered 200 after {args.startup_seconds} s", flush=True)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise TimeoutError(f"specdec serve did not answer /health within {args.startup_timeout_s} s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL if it lingers."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


# -------------------------------------------------------------------------- report
def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def markdown(meta: dict, levels: list[LevelResult]) -> str:
    command = " ".join(meta["argv"])
    lines = [
        f"Date: {meta['date']}. Model: {meta['model']}. Machine: {json.dumps(meta['machine'])}.",
        f"Speculation (server): {json.dumps(meta['speculative_config'])}. "
        f"{meta['max_tokens']} output tokens per request (EOS ignored), temperature "
        f"{meta['temperature']}, at least {meta['requests_per_level']} requests per level; "
        f"prompts: {meta['prompts']}.",
        "",
        "```",
        command,
        "```",
        "",
        "| mode | load | requests | failed | req/s | output tok/s | TTFT p50/p90/p99 ms "
        "| TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | mean acceptance length "
        "| client processes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in levels:
        lines.append(
            f"| {x.mode} | {x.label} | {x.num_requests} | {x.num_failed} "
            f"| {x.requests_per_s:.2f} | {x.output_tokens_per_s:.1f} "
            f"| {x.ttft_p50_ms:.0f}/{x.ttft_p90_ms:.0f}/{x.ttft_p99_ms:.0f} "
            f"| {x.tpot_p50_ms:.1f}/{x.tpot_p90_ms:.1f}/{x.tpot_p99_ms:.1f} "
            f"| {x.itl_p50_ms:.1f}/{x.itl_p90_ms:.1f}/{x.itl_p99_ms:.1f} "
            f"| {x.mean_acceptance_length:.2f} | {x.client_processes} |"
        )
    by_key = {(x.mode, x.label): x for x in levels}
    labels = list(dict.fromkeys(x.label for x in levels if not x.mode.startswith("generate")))
    header = "| load | plain tok/s | spec tok/s | spec / plain |"
    no_spec = any(x.mode == NO_SPEC_MODE for x in levels)
    if no_spec:
        header += " `--no-spec` server tok/s | spec / `--no-spec` |"
    ceiling = any(x.mode.startswith("generate") for x in levels)
    if ceiling:
        header += " server / `LLM.generate`: plain | spec |"
    columns = 4 + 2 * no_spec + 2 * ceiling
    lines += ["", header, "|" + "---|" * columns]
    for label in labels:
        plain, spec = by_key.get(("plain", label)), by_key.get(("spec", label))
        if plain is None or spec is None:
            continue
        ratio = spec.output_tokens_per_s / plain.output_tokens_per_s
        row = (
            f"| {label} | {plain.output_tokens_per_s:.1f} | {spec.output_tokens_per_s:.1f} "
            f"| {ratio:.2f} |"
        )
        if no_spec:
            base = by_key.get((NO_SPEC_MODE, label))
            row += (
                f" {base.output_tokens_per_s:.1f} | "
                f"{spec.output_tokens_per_s / base.output_tokens_per_s:.2f} |"
                if base
                else " | |"
            )
        if ceiling:
            for server, mode in ((plain, "generate plain"), (spec, "generate spec")):
                engine = by_key.get((mode, label))
                row += (
                    f" {server.output_tokens_per_s / engine.output_tokens_per_s:.2f} |"
                    if engine
                    else " |"
                )
        lines.append(row)
    lines += paths_table(meta)
    mixed = [x for x in levels if x.tpot_p50_ms_by_rule]
    if mixed:
        lines += ["", f"Rules ({meta['rules']}): TPOT p50 ms by rule", ""]
        lines += ["| mode | load | " + " | ".join(RULES) + " |", "|---|---|" + "---|" * len(RULES)]
        for x in mixed:
            tpot = x.tpot_p50_ms_by_rule
            cells = " | ".join(f"{tpot.get(rule, float('nan')):.1f}" for rule in RULES)
            lines.append(f"| {x.mode} | {x.label} | {cells} |")
    return "\n".join(lines) + "\n"


# The step counters of the paths table: (column, counter); a row's counters as they grew
PATH_COLUMNS = (
    ("overlapped steps", "specdec:num_overlapped_steps_total"),
    ("of them with prefill", "specdec:num_overlapped_prefill_steps_total"),
    ("device rounds", "specdec:num_device_rounds_total"),
    ("round joins", "specdec:num_round_joins_total"),
    ("synchronous steps", "specdec:num_sync_steps_total"),
    ("plain-arm steps", "specdec:num_plain_arm_steps_total"),
    ("rows prefill", "specdec:num_rows_total[kind=prefill]"),
    ("rows plain", "specdec:num_rows_total[kind=plain]"),
    ("rows speculative", "specdec:num_rows_total[kind=speculative]"),
)


def paths_table(meta: dict) -> list[str]:
    """Markdown lines: per server level, how its engine ran it (the step counters that level
    grew: joining visits and joins show as overlapped prefill steps beside device rounds)."""
    rows = dict(meta.get("engine_counters_by_level") or {})
    for key, grown in (
        (meta.get("no_spec_server") or {}).get("engine_counters_by_level") or {}
    ).items():
        rows[f"{NO_SPEC_MODE} {key.split(' ', 1)[1]}"] = grown
    rows.update(meta.get("generate_counters_by_level") or {})
    if not rows:
        return []
    lines = [
        "",
        "Engine paths by level (the server's step counters, and the in-process engine's for "
        "`LLM.generate`, as each level grew them)",
        "",
    ]
    lines.append("| level | " + " | ".join(name for name, _ in PATH_COLUMNS) + " |")
    lines.append("|---|" + "---|" * len(PATH_COLUMNS))
    for level, grown in rows.items():
        cells = " | ".join(f"{grown.get(counter, 0):.0f}" for _, counter in PATH_COLUMNS)
        lines.append(f"| {level} | {cells} |")
    return lines


def plot(levels: list[LevelResult], path: Path) -> None:
    """Output tokens/s and TTFT p99 against the load, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(x.label for x in levels))
    fig, (rate_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(x.mode for x in levels):
        rows = {x.label: x for x in levels if x.mode == mode}
        xs = [i for i, label in enumerate(labels) if label in rows]
        rate_axis.plot(
            xs, [rows[labels[i]].output_tokens_per_s for i in xs], marker="o", label=mode
        )
        if not mode.startswith("generate"):
            ttft_axis.plot(xs, [rows[labels[i]].ttft_p99_ms for i in xs], marker="o", label=mode)
    for axis, title in ((rate_axis, "output tokens/s"), (ttft_axis, "TTFT p99 (ms)")):
        axis.set_xticks(range(len(labels)), labels)
        axis.set_xlabel("load")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        "argv": [Path(sys.argv[0]).as_posix(), *sys.argv[1:]],
        "url": args.url,
        "model": args.serve or models["data"][0]["id"],
        "max_model_len": models["data"][0].get("max_model_len"),
        "serve_command": getattr(args, "serve_command", None),
        "startup_seconds": getattr(args, "startup_seconds", None),  # process start to /health
        "speculative_config": (args.speculative_config or "the server's default")
        if args.serve
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_argument_group("server")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    target.add_argument(
        "--serve", default=None, metavar="MODEL", help="start `specdec serve MODEL` and use it"
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
        "(issue 34's mixed traffic; TPOT p50 reported per rule); none: no rules",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--out-dir", default="bench-results/serve", help="writes serve.json and serve.md here"
    )
    output.add_argument(
        "--out", default=None, help="or: this JSON file, with the .md (and server.log) beside it"
    )
    args = parser.parse_args()
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
        parser.error("--generate runs requests without rules: not with --rules mixed")
    if args.request_rate and any(rate <= 0 for rate in args.request_rate):
        parser.error("--request-rate must be > 0")
    if args.prompts_file:
        PROMPTS[:] = read_prompts(args.prompts_file)
    if args.threads is None:
        from specdec.cli.flags import default_threads

        args.threads = default_threads()

    out_json = Path(args.out) if args.out else Path(args.out_dir) / "serve.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args, out_json.parent / "server.log") if args.serve else None
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
    if any(x.num_failed for x in levels):
        sys.exit(1)


if __name__ == "__main__":
    main()
