"""The `specdec` command line: one subcommand per task (`generate`, `bench`, `audit`).

Parses arguments and prints results; the work itself lives in the library (`specdec.conformance`
for the audit), so that tests run exactly what the command runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from specdec import __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="An LLM inference engine whose speculative decoding is exact and reproducible.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_bench(commands)
    _add_serve(commands)

    audit = commands.add_parser(
        "audit",
        help="statistical conformance audit of the sampler and the three verifiers",
        description=(
            "Drive the real sampler and verifiers on toy Markov models over many seeded requests "
            "and test what they emit against exact probabilities. Each check that must pass "
            "fails by chance with probability <= 1e-6; negative controls (deliberately broken "
            "variants) must be rejected. Exit status 0 iff every verdict is as expected."
        ),
    )
    audit.add_argument(
        "--quick", action="store_true", help="smaller samples: same thresholds, less power"
    )
    audit.add_argument(
        "--seed", type=int, default=0, help="mixed into every request seed (default 0)"
    )
    audit.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the audit's tensors are small, and one thread does "
        "not stall on a busy machine as OpenMP spin-waits do)",
    )
    audit.add_argument(
        "-v", "--verbose", action="store_true", help="print each check's numbers under its row"
    )
    audit.set_defaults(handler=_audit)
    return parser


GENERATE_MAX_TOKENS = 256
# The speculation `generate` and `bench` use when --speculative-config is not given.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def _add_generate(commands) -> None:
    from specdec.engine.args import add_engine_arguments, add_sampling_arguments

    generate = commands.add_parser(
        "generate",
        help="generate text for a prompt, streaming tokens, then print acceptance figures",
        description="Generate for one prompt with speculative decoding (default: "
        f"{DEFAULT_SPECULATIVE_CONFIG}) on the given model (default: the built-in "
        "SmolLM2-135M-Instruct), streaming the text as it is produced.",
    )
    generate.add_argument("prompt", help="the prompt (a user message for chat models)")
    generate.add_argument("--model", default=None, help="HF directory or GGUF file")
    generate.add_argument(
        "--no-chat", action="store_true", help="do not wrap the prompt in the chat template"
    )
    generate.add_argument("--no-spec", action="store_true", help="decode without speculation")
    # A whole answer rather than SamplingParams' 16-token default (it still stops at EOS).
    add_sampling_arguments(generate, max_tokens=GENERATE_MAX_TOKENS)
    add_engine_arguments(generate)
    generate.set_defaults(handler=_generate)


def _add_bench(commands) -> None:
    from specdec.engine.args import add_engine_arguments

    bench = commands.add_parser(
        "bench",
        help="speculative vs plain decoding: tokens/s, TPOT, acceptance (JSON and PNG)",
        description="Run one workload with and without speculation on the same model, prompts "
        "and seeds; print a table and write JSON and a PNG plot.",
    )
    bench.add_argument("--model", default=None, help="HF directory or GGUF file")
    bench.add_argument("--num-prompts", type=int, default=8, help="requests in the workload")
    bench.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    bench.add_argument("--seed", type=int, default=0, help="seed of request i is seed + i")
    bench.add_argument(
        "--out", default="bench-results/bench.json", help="JSON path (the PNG goes beside it)"
    )
    add_engine_arguments(bench)
    bench.set_defaults(handler=_bench)


def _add_serve(commands) -> None:
    from specdec.engine.args import add_engine_arguments
    from specdec.server.config import ServerConfig

    defaults = ServerConfig()
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)",
        description="Serve MODEL (default: the built-in SmolLM2-135M-Instruct) over OpenAI's "
        "/v1/completions and /v1/chat/completions. Requests must name the model as the served "
        "name (--served-model-name; default: the model path's last component without its "
        "suffix, or 'default' for the built-in model) or as 'default'. Each request may set "
        '"speculative": {"enabled", "num_speculative_tokens", "method"}; without '
        "--speculative-config the server has no drafter and speculation requests are refused.",
    )
    serve.add_argument("model", nargs="?", default=None, help="HF directory or GGUF file")
    serve.add_argument("--served-model-name", default=None, help="the model name requests use")
    serve.add_argument("--host", default=defaults.host, help=f"(default: {defaults.host})")
    serve.add_argument(
        "--port", type=int, default=defaults.port, help=f"(default: {defaults.port})"
    )
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route"
    )
    for name in ("max_request_bytes", "max_tokens_limit", "max_n", "max_logprobs"):
        default = getattr(defaults, name)
        serve.add_argument(
            "--" + name.replace("_", "-"), type=int, default=default, help=f"(default: {default})"
        )
    add_engine_arguments(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import uvicorn

    from specdec.engine.args import engine_kwargs, speculative_config
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.server import AsyncEngine, ServerConfig, build_app

    name = args.served_model_name or (Path(args.model).stem if args.model else "default")
    config = ServerConfig(
        served_model_name=name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
    )
    engine = LLMEngine(
        EngineConfig(model=args.model, **engine_kwargs(args)), speculative_config(args, None)
    )
    print(f"serving {name!r} on http://{config.host}:{config.port}", file=sys.stderr)
    uvicorn.run(
        build_app(AsyncEngine(engine), config),
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=config.shutdown_timeout_s,
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from specdec.engine.args import engine_kwargs, sampling_params, speculative_config
    from specdec.engine.llm import LLM

    spec = None if args.no_spec else speculative_config(args, DEFAULT_SPECULATIVE_CONFIG)
    llm = LLM(args.model, speculative_config=spec, **engine_kwargs(args))
    params = sampling_params(args)
    printed = [0]

    def stream(output) -> None:
        text = output.outputs[0].text
        sys.stdout.write(text[printed[0] :])
        sys.stdout.flush()
        printed[0] = len(text)

    started = time.perf_counter()
    use_chat = not args.no_chat and llm.tokenizer is not None and llm.tokenizer.chat_template
    if use_chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, on_tokens=stream)
    else:
        outputs = llm.generate(args.prompt, params, on_tokens=stream)
    elapsed = time.perf_counter() - started
    out = outputs[0]
    completion = out.outputs[0]
    stats = out.spec_decode_stats
    print()
    print(
        f"\n[{len(completion.token_ids)} tokens in {elapsed:.2f} s "
        f"({len(completion.token_ids) / elapsed:.1f} tokens/s), finish: "
        f"{completion.finish_reason}, seed: {out.seed}]",
        file=sys.stderr,
    )
    if spec is not None:
        per_position = ", ".join(f"{rate:.2f}" for rate in stats["acceptance_per_position"])
        print(
            f"[speculation {spec.method} K={spec.num_speculative_tokens} "
            f"{spec.rejection_sample_method}: mean acceptance length "
            f"{stats['mean_acceptance_length']:.2f}, acceptance rate "
            f"{stats['acceptance_rate']:.2f}, per position {per_position}]",
            file=sys.stderr,
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec import bench
    from specdec.engine.args import engine_kwargs, speculative_config
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    spec = speculative_config(args, DEFAULT_SPECULATIVE_CONFIG)
    plain = LLM(args.model, **engine_kwargs(args))
    prompts = [
        plain.tokenizer.encode_chat([{"role": "user", "content": text}])
        if plain.tokenizer is not None and plain.tokenizer.chat_template
        else plain.tokenizer.encode(text)
        for text in (bench.DEFAULT_PROMPTS * args.num_prompts)[: args.num_prompts]
    ]
    params = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=args.output_len,
            ignore_eos=True,
            seed=args.seed + i,
        )
        for i in range(len(prompts))
    ]
    plain_figures, plain_outputs = bench.run_workload(plain, "plain", prompts, params)
    del plain
    spec_llm = LLM(args.model, speculative_config=spec, **engine_kwargs(args))
    name = f"{spec.method} K={spec.num_speculative_tokens}"
    spec_figures, spec_outputs = bench.run_workload(spec_llm, name, prompts, params)
    same = [
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(plain_outputs, spec_outputs, strict=True)
    ]
    runs = [plain_figures, spec_figures]
    print(
        f"{'run':>14} {'tokens/s':>9} {'TTFT s':>8} {'TPOT ms':>8} {'accept len':>10}  per position"
    )
    for run in runs:
        positions = " ".join(f"{rate:.2f}" for rate in run.acceptance_per_position)
        print(
            f"{run.name:>14} {run.tokens_per_s:>9.1f} {run.mean_ttft_s:>8.3f} "
            f"{run.mean_tpot_s * 1e3:>8.1f} {run.mean_acceptance_length:>10.2f}  {positions}"
        )
    speedup = spec_figures.tokens_per_s / plain_figures.tokens_per_s
    print(
        f"speed-up {speedup:.2f}x; outputs identical to plain in {sum(same)}/{len(same)} requests"
        + (" (greedy: must be all)" if args.temperature == 0 else "")
    )
    meta = {
        "title": f"specdec bench: {args.model or 'SmolLM2-135M-Instruct'}, {name}",
        "machine": bench.machine_description(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "specdec " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "specdec bench",
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "temperature": args.temperature,
        "speculative_config": {f: getattr(spec, f) for f in spec.__slots__},
        "speedup": speedup,
        "identical_outputs": sum(same),
    }
    png = bench.write_results(Path(args.out), runs, meta)
    print(f"wrote {args.out} and {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `specdec` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


def _verdict(result) -> str:
    if result.expected_to_pass:
        return "pass" if result.passed else "FAIL"
    return "NOT REJECTED (no power)" if result.passed else "rejected (as it must be)"


def _audit(args: argparse.Namespace) -> int:
    import torch

    from specdec.conformance import run_audit

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    done = 0

    def progress(result, seconds: float) -> None:
        nonlocal done
        done += 1
        mark = "ok " if result.ok else "!! "
        print(f"{mark}[{done:3d}] {seconds:5.1f}s  {result.name}", file=sys.stderr, flush=True)

    mode = "quick" if args.quick else "full"
    print(f"specdec audit ({mode}, seed {args.seed}): one line per check", file=sys.stderr)
    results = run_audit(args.quick, seed=args.seed, on_result=progress)
    elapsed = time.perf_counter() - started

    width = max(len(r.name) for r in results)
    header = f"{'check':<{width}}  {'statistic':>10}  {'threshold':>9}  verdict"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.name:<{width}}  {r.statistic:>10.3g}  {r.threshold:>9.3g}  {_verdict(r)}")
        if args.verbose:
            print(f"{'':<{width}}    {r.detail}")
    print("-" * len(header))
    print(
        "statistic <= threshold passes. -log10 p for chi-square and exact tests (6 = p 1e-6); "
        "|z| (or one-sided z) for z-tests (5.3);\nmismatches for identity and invariance "
        "checks (0); relative error for the exact far-tail mass (1e-4). -v shows the numbers."
    )
    controls = [r for r in results if not r.expected_to_pass]
    checks = [r for r in results if r.expected_to_pass]
    failed = [r for r in results if not r.ok]
    print(
        f"{sum(r.passed for r in checks)}/{len(checks)} checks passed, "
        f"{sum(not r.passed for r in controls)}/{len(controls)} negative controls rejected "
        f"in {elapsed:.0f} s: " + ("AUDIT PASSED" if not failed else "AUDIT FAILED")
    )
    for r in failed:
        print(f"  unexpected: {r.name}: {r.detail}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
