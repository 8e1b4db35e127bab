"""The client side of the serving benchmark: streaming chat requests against a server, one load
level at a time (concurrency or Poisson arrivals, over several client processes), and the
figures of a level (requests/s, output tokens/s, TTFT / TPOT / ITL percentiles)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specdec.bench import DEFAULT_PROMPTS
from specdec.bench_serve.rules import RULES, may_end_early, rule_of

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
    a second (seeded: the same load for every mode).

    RNG: `Stream.BENCH_LOAD` keyed by (seed, request index), one float64 lane: the exponential
    gap -ln(u) / rate before each request."""
    import torch

    from specdec.rng import Stream, uniform

    seeds = torch.full((count,), seed, dtype=torch.int64)
    positions = torch.arange(count, dtype=torch.int64)
    u = uniform(seeds, positions, Stream.BENCH_LOAD, 1, dtype=torch.float64)[:, 0]
    return torch.cumsum(-torch.log(u) / rate, 0).tolist()


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
