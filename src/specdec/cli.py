"""The `specdec` command line: one subcommand per task (`generate`, `bench`, `serve`, `audit`,
`train-drafter`).

Parses arguments and prints results; the work itself lives in the library (`specdec.audit`
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
    _add_train_drafter(commands)

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
# The speculation `generate` and `bench` use when --speculative-config is not given: the shipped
# EAGLE head for the built-in model (`default_spec`), prompt lookup for any other model.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def default_spec(model: str | None) -> dict:
    """The default speculation of `generate` and `bench` for `model` (None: the built-in one)."""
    if model is None:
        from specdec.drafters.default import default_speculative_config

        shipped = default_speculative_config()
        if shipped is not None:
            return shipped
    return DEFAULT_SPECULATIVE_CONFIG


def _add_generate(commands) -> None:
    from specdec.engine.args import add_engine_arguments, add_sampling_arguments

    generate = commands.add_parser(
        "generate",
        help="generate text for a prompt, streaming tokens, then print acceptance figures",
        description="Generate for one prompt with speculative decoding on the given model "
        "(default: the built-in SmolLM2-135M-Instruct), streaming the text as it is produced. "
        "Default speculation: the shipped EAGLE head at K=2 for the built-in model, "
        f"{DEFAULT_SPECULATIVE_CONFIG} for other models.",
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
    sweep = bench.add_argument_group(
        "acceptance sweep (--sweep): every drafter x K x temperature against plain decoding"
    )
    sweep.add_argument("--sweep", action="store_true", help="run the sweep instead")
    sweep.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='a speculative_config to compare, e.g. ngram=\'{"method": "ngram"}\' (repeatable; '
        "default: the shipped EAGLE head and n-gram for the built-in model, n-gram otherwise)",
    )
    sweep.add_argument("--ks", default="2,4,6", help="comma-separated K values (default 2,4,6)")
    sweep.add_argument(
        "--temperatures", default="0,1", help="comma-separated temperatures (default 0,1)"
    )
    sweep.add_argument(
        "--prompts-file",
        default=None,
        help='.jsonl of {"prompt": ...} user messages (default: the built-in workload)',
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
    limits = ("max_request_bytes", "max_tokens_limit", "max_n", "max_prompts", "max_logprobs")
    for name in limits:
        default = getattr(defaults, name)
        serve.add_argument(
            "--" + name.replace("_", "-"), type=int, default=default, help=f"(default: {default})"
        )
    add_engine_arguments(serve)
    serve.set_defaults(handler=_serve)


def _add_train_drafter(commands) -> None:
    from specdec.train.kind import TrainOptions
    from specdec.train.trainer import TrainConfig

    defaults, run = TrainOptions(), TrainConfig(kind="", data=(), out="")
    train = commands.add_parser(
        "train-drafter",
        help="train a drafter (draft_model, eagle/mtp, ...) by distillation from the target",
        description="Distil a drafter from the target: annotate the data with the target's hidden "
        "features (self-distillation: the target's own answers to .jsonl chat prompts; or text "
        "files), train with a progress bar, checkpoint every --checkpoint-every steps (resume "
        "with --resume), then measure held-out acceptance at K=--eval-k through the engine. "
        'DIR then holds config.json + model.safetensors: speculative_config={"method": KIND, '
        '"model": DIR}.',
    )
    train.add_argument("--target", default=None, help="HF directory or GGUF (default: built-in)")
    train.add_argument("--kind", required=True, help="draft_model, eagle, mtp, ...")
    train.add_argument(
        "--data", action="append", required=True, help=".jsonl prompts, text file or folder"
    )
    train.add_argument("--out", required=True, help="output directory DIR")
    train.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    train.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="kind-specific setting (e.g. draft_vocab_size=8192, ttt_steps=3, draft_layers=2)",
    )
    for name in (
        "seed",
        "max_steps",
        "batch_size",
        "seq_len",
        "lr",
        "warmup_steps",
        "weight_decay",
        "grad_clip",
        "checkpoint_every",
    ):
        default = getattr(defaults, name)
        train.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"(default: {default})",
        )
    for name in (
        "max_text_tokens",
        "max_prompts",
        "time_limit_s",
        "gen_max_tokens",
        "gen_repeats",
        "gen_batch",
        "holdout_fraction",
        "eval_prompts",
        "eval_max_tokens",
        "eval_k",
        "device",
    ):
        default = getattr(run, name)
        train.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"(default: {default})",
        )
    train.add_argument(
        "--gen-temperatures",
        default=",".join(str(t) for t in run.gen_temperatures),
        help="comma-separated; prompt i is answered at temperature i mod len "
        f"(default: {','.join(str(t) for t in run.gen_temperatures)})",
    )
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    train.set_defaults(handler=_train_drafter)


def _train_drafter(args: argparse.Namespace) -> int:
    import torch

    from specdec.train.kind import TrainOptions
    from specdec.train.trainer import TrainConfig, train_drafter

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        extra[key] = value
    names = [f for f in TrainOptions.__dataclass_fields__ if f != "extra"]
    options = TrainOptions(**{name: getattr(args, name) for name in names}, extra=extra)
    config = TrainConfig(
        kind=args.kind,
        data=tuple(args.data),
        out=args.out,
        target=args.target,
        options=options,
        resume=args.resume,
        max_text_tokens=args.max_text_tokens,
        max_prompts=args.max_prompts,
        time_limit_s=args.time_limit_s,
        gen_max_tokens=args.gen_max_tokens,
        gen_temperatures=tuple(float(t) for t in args.gen_temperatures.split(",")),
        gen_repeats=args.gen_repeats,
        gen_batch=args.gen_batch,
        holdout_fraction=args.holdout_fraction,
        eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens,
        eval_k=args.eval_k,
        device=args.device,
    )
    train_drafter(config, log=lambda message: print(message, file=sys.stderr, flush=True))
    return 0


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
        max_prompts=args.max_prompts,
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

    spec = None if args.no_spec else speculative_config(args, default_spec(args.model))
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

    if args.sweep:
        return _bench_sweep(args)
    spec = speculative_config(args, default_spec(args.model))
    plain = LLM(args.model, speculative_config=None, **engine_kwargs(args))
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


def _bench_sweep(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from specdec import bench
    from specdec.engine.args import engine_kwargs
    from specdec.models import Tokenizer, default_model_path, load_model

    drafters = {}
    for item in args.drafter:
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--drafter expects NAME=JSON, got {item!r}")
        drafters[name] = json.loads(text)
    if not drafters:
        shipped = default_spec(args.model)
        if shipped is not DEFAULT_SPECULATIVE_CONFIG:
            drafters["eagle"] = shipped
        drafters["ngram"] = DEFAULT_SPECULATIVE_CONFIG
    if args.prompts_file:
        lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    else:
        texts = list(bench.DEFAULT_PROMPTS)
    texts = (texts * args.num_prompts)[: args.num_prompts]
    tokenizer: Tokenizer | None = load_model(args.model or default_model_path()).tokenizer
    if tokenizer is None:
        raise SystemExit("the sweep needs a model with a tokenizer")
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": text}])
        if tokenizer.chat_template
        else tokenizer.encode(text)
        for text in texts
    ]
    points = bench.run_sweep(
        args.model,
        drafters,
        prompts,
        [int(k) for k in args.ks.split(",")],
        [float(t) for t in args.temperatures.split(",")],
        args.output_len,
        args.seed,
        engine_kwargs(args),
    )
    table = bench.sweep_table(points)
    print(table)
    meta = {
        "title": f"specdec bench --sweep: {args.model or 'SmolLM2-135M-Instruct'}",
        "machine": bench.machine_description(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "specdec " + " ".join(sys.argv[1:]),
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "drafters": drafters,
        "table": table,
    }
    png = bench.write_sweep(Path(args.out), points, meta)
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

    from specdec.audit import run_audit

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
