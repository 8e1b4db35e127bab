"""A load test of `specdec serve`: many concurrent seeded streams, some clients leaving early, and a
SIGTERM with long streams open. Every check fails the run (exit status 1); the JSON says which.

Checks:
1. Every stream that was not cut by its client ends with a last chunk, `[DONE]`, and exactly
   `--max-tokens` tokens (EOS ignored; `usage` counts them): nothing lost or duplicated; every
   response id is distinct.
2. `--disconnects` clients close their stream after a few chunks; the server goes on serving the
   rest, and afterwards runs nothing and holds no KV block (`/metrics`).
3. `--solo` of the seeded streams are sent again alone (not streamed): the same text.
4. With `--serve` (the script's own server): `--sigterm-streams` long streams are open when the
   server gets SIGTERM; each ends with a last chunk (finish_reason "abort") and `[DONE]`, and the
   process exits within `--exit-within-s`.

    python benchmarks/load_test_serve.py --serve MODEL --device cuda --streams 256 \\
        --disconnects 32 --max-tokens 128 --out load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specdec.bench_serve.server_process import start_server, stop_server

REQUEST_TIMEOUT_S = 600.0
# /metrics gauges that are 0 on a server with nothing to do.
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class StreamResult:
    seed: int
    cut_after: int | None  # chunks read before the client left (None: read to the end)
    ids: set[str] = field(default_factory=set)
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False
    error: str | None = None


def body(args: argparse.Namespace, seed: int, max_tokens: int, stream: bool) -> dict:
    return {
        "model": args.model,
        "messages": [{"role": "user", "content": f"Tell me a story about the number {seed}."}],
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "seed": seed,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


async def one_stream(
    http: httpx.AsyncClient, payload: dict, result: StreamResult, chunks_seen: list
) -> None:
    try:
        async with http.stream("POST", "/v1/chat/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    result.done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message")
                    continue
                result.ids.add(chunk["id"])
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    result.text += choice["delta"].get("content") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                result.chunks += 1
                chunks_seen.append(1)
                if result.cut_after is not None and result.chunks >= result.cut_after:
                    return  # the client leaves: closing the response drops the connection
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"


async def load_phase(args: argparse.Namespace) -> list[StreamResult]:
    rng = random.Random(args.seed)
    cut = set(rng.sample(range(args.streams), args.disconnects))
    results = [
        StreamResult(seed=i, cut_after=rng.randint(1, 5) if i in cut else None)
        for i in range(args.streams)
    ]
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=args.url, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as http:
        seen: list = []
        await asyncio.gather(
            *[one_stream(http, body(args, r.seed, args.max_tokens, True), r, seen) for r in results]
        )
    return results


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name.split("{")[0]] = float(value)
    return values


def wait_idle(url: str, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(url)
        idle = all(values.get(name, 1) == 0 for name in IDLE_GAUGES)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


async def sigterm_phase(args: argparse.Namespace, server) -> dict:
    """Long streams open, then SIGTERM: each must end with an abort chunk and [DONE]."""
    results = [StreamResult(seed=1000 + i, cut_after=None) for i in range(args.sigterm_streams)]
    async with httpx.AsyncClient(base_url=args.url, timeout=REQUEST_TIMEOUT_S) as http:
        seen: list = []
        tasks = [
            asyncio.ensure_future(
                one_stream(http, body(args, r.seed, args.sigterm_max_tokens, True), r, seen)
            )
            for r in results
        ]
        deadline = time.monotonic() + 120
        while len(seen) < 2 * len(results) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.gather(*tasks)
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, server.wait, args.exit_within_s + 30)
        exited_s = time.monotonic() - signalled
    except Exception:
        exited_s = None
    ended = sum(r.done and r.finish_reason == "abort" for r in results)
    return {
        "streams": len(results),
        "ended_with_abort_and_done": ended,
        "exit_s": exited_s,
        "ok": ended == len(results) and exited_s is not None and exited_s <= args.exit_within_s,
    }


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    results = asyncio.run(load_phase(args))
    load_s = time.perf_counter() - started
    full = [r for r in results if r.cut_after is None]
    cut = [r for r in results if r.cut_after is not None]
    problems = []
    for r in full:
        if r.error or not r.done or r.finish_reason != "length":
            problems.append(f"stream {r.seed}: error={r.error} done={r.done} end={r.finish_reason}")
        elif r.completion_tokens != args.max_tokens:
            problems.append(f"stream {r.seed}: {r.completion_tokens} tokens")
    all_ids = [next(iter(r.ids)) for r in results if len(r.ids) == 1]
    if len(all_ids) != len(set(all_ids)) or any(len(r.ids) > 1 for r in results):
        problems.append("response ids repeat or change within a stream")
    idle = wait_idle(args.url, args.idle_timeout_s)
    if any(idle.get(name, 1) != 0 for name in IDLE_GAUGES):
        problems.append(f"not idle afterwards: {[idle.get(name) for name in IDLE_GAUGES]}")
    solo_seeds = [r.seed for r in full[: args.solo]]
    mismatched = []
    for seed in solo_seeds:
        reply = httpx.post(
            f"{args.url}/v1/chat/completions",
            json=body(args, seed, args.max_tokens, False),
            timeout=REQUEST_TIMEOUT_S,
        ).json()
        if reply["choices"][0]["message"]["content"] != results[seed].text:
            mismatched.append(seed)
    if mismatched:
        problems.append(f"streams unequal to their solo runs: seeds {mismatched}")
    tokens = sum(r.completion_tokens or 0 for r in full)
    return {
        "streams": args.streams,
        "disconnects": len(cut),
        "completed": sum(r.done for r in full),
        "load_seconds": round(load_s, 2),
        "output_tokens_per_s": round(tokens / load_s, 1),
        "idle_after": {k: idle.get(k) for k in IDLE_GAUGES},
        "solo_compared": len(solo_seeds),
        "solo_equal": len(solo_seeds) - len(mismatched),
        "problems": problems,
        "ok": not problems,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server")
    parser.add_argument("--serve", default=None, help="start `specdec serve MODEL` and use it")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--model", default="default", help="the served model name requests use")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--disconnects", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="which streams are cut, and when")
    parser.add_argument("--solo", type=int, default=16, help="seeded streams re-run alone")
    parser.add_argument("--idle-timeout-s", type=float, default=60.0)
    parser.add_argument("--sigterm-streams", type=int, default=16)
    parser.add_argument("--sigterm-max-tokens", type=int, default=4000)
    parser.add_argument("--exit-within-s", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="JSON report (default: stdout only)")
    args = parser.parse_args()
    if (args.url is None) == (args.serve is None):
        parser.error("give exactly one of --url and --serve")
    if not 0 <= args.disconnects <= args.streams:
        parser.error("--disconnects must be between 0 and --streams")
    out = Path(args.out) if args.out else None
    log = (out.parent if out else Path(".")) / "load_test_server.log"
    server = start_server(args, log) if args.serve else None
    try:
        report = {"command": " ".join(sys.argv), "load": run(args)}
        if server is not None and args.sigterm_streams:
            report["sigterm"] = asyncio.run(sigterm_phase(args, server))
    finally:
        if server is not None:
            stop_server(server)
    report["ok"] = report["load"]["ok"] and report.get("sigterm", {"ok": True})["ok"]
    text = json.dumps(report, indent=2, default=list)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
