"""Drives a running `specdec serve` at several concurrency levels, speculation on vs off.

Each level sends `--requests-per-level` (at least the concurrency) streaming chat requests with
`--concurrency` in flight at once, greedy with ignore_eos and fixed seeds, and measures requests/s,
output tokens/s, TTFT and TPOT percentiles; "spec" requests ask `speculative: {"enabled": true}`
(the server's --speculative-config), "plain" ones `{"enabled": false}`. Writes JSON.

    specdec serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' &
    python benchmarks/serve.py --url http://127.0.0.1:8000 --out bench-results/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from specdec.bench import DEFAULT_PROMPTS

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class RequestResult:
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    accepted_tokens: int
    drafts: int


@dataclass(frozen=True, slots=True)
class LevelResult:
    mode: str
    concurrency: int
    num_requests: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    tpot_p99_ms: float
    mean_acceptance_length: float


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
    http: httpx.AsyncClient, model: str, prompt: str, seed: int, max_tokens: int, spec: bool
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": {"enabled": spec},
    }
    started = time.perf_counter()
    first = None
    usage, stats = {}, {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
                stats = chunk.get("spec_decode_stats") or {}
    done = time.perf_counter()
    first = first if first is not None else done
    tokens = usage.get("completion_tokens", 0)
    return RequestResult(
        ttft_s=first - started,
        tpot_s=(done - first) / (tokens - 1) if tokens > 1 else None,
        latency_s=done - started,
        output_tokens=tokens,
        accepted_tokens=stats.get("num_accepted_tokens", 0),
        drafts=stats.get("num_drafts", 0),
    )


async def run_level(args: argparse.Namespace, concurrency: int, spec: bool) -> LevelResult:
    num_requests = max(concurrency, args.requests_per_level)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async with httpx.AsyncClient(
        base_url=args.url, timeout=REQUEST_TIMEOUT_S, limits=limits, headers=headers
    ) as http:

        async def gated(i: int) -> RequestResult:
            async with gate:
                prompt = DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]
                return await one_request(http, args.model, prompt, i, args.max_tokens, spec)

        started = time.perf_counter()
        results = await asyncio.gather(*[gated(i) for i in range(num_requests)])
        duration = time.perf_counter() - started
    ttft = [r.ttft_s * 1e3 for r in results]
    tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    drafts = sum(r.drafts for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    return LevelResult(
        mode="spec" if spec else "plain",
        concurrency=concurrency,
        num_requests=num_requests,
        duration_s=duration,
        requests_per_s=num_requests / duration,
        output_tokens_per_s=sum(r.output_tokens for r in results) / duration,
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p90_ms=percentile(ttft, 0.9),
        ttft_p99_ms=percentile(ttft, 0.99),
        tpot_p50_ms=percentile(tpot, 0.5),
        tpot_p90_ms=percentile(tpot, 0.9),
        tpot_p99_ms=percentile(tpot, 0.99),
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="default", help="the served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests-per-level", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench-results/serve.json")
    args = parser.parse_args()

    levels = []
    header = (
        f"{'mode':>5} {'conc':>4} {'reqs':>4} {'req/s':>6} {'tok/s':>7} "
        f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'acc len':>7}"
    )
    print(header)
    for concurrency in args.concurrency:
        for spec in (False, True):
            level = asyncio.run(run_level(args, concurrency, spec))
            levels.append(level)
            ttft = f"{level.ttft_p50_ms:.0f}/{level.ttft_p90_ms:.0f}/{level.ttft_p99_ms:.0f}"
            tpot = f"{level.tpot_p50_ms:.1f}/{level.tpot_p90_ms:.1f}/{level.tpot_p99_ms:.1f}"
            print(
                f"{level.mode:>5} {concurrency:>4} {level.num_requests:>4} "
                f"{level.requests_per_s:>6.2f} {level.output_tokens_per_s:>7.1f} {ttft:>22} "
                f"{tpot:>22} {level.mean_acceptance_length:>7.2f}",
                flush=True,
            )
    models = httpx.get(
        f"{args.url}/v1/models",
        timeout=30.0,
        headers=({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}),
    ).json()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "url": args.url,
        "model": models["data"][0]["id"],
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests_per_level,
    }
    out.write_text(json.dumps({"meta": meta, "levels": [asdict(x) for x in levels]}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
