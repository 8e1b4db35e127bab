"""`specdec bench`: speculative against plain decoding on one workload, or the acceptance sweep
(`--serve` / `--url`, the serving benchmark, has its own flags: `specdec.bench_serve`)."""

from __future__ import annotations

import argparse
import time

from specdec.cli.flags import DEFAULT_SPECULATIVE_CONFIG, default_spec


def add_bench(commands) -> None:
    from specdec.cli.flags import add_engine_arguments, add_model_arguments, add_threads_flag

    bench = commands.add_parser(
        "bench",
        help="speculative vs plain decoding: tokens/s, TPOT, acceptance (JSON and PNG)",
        description="Run one workload with and without speculation on the same model (MODEL "
        "or --model; default: the built-in SmolLM2-135M-Instruct), prompts and seeds; print a "
        "table and write JSON and a PNG plot.",
    )
    add_model_arguments(bench)
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
        "--trees",
        default="",
        help="comma-separated draft trees NODESxDEPTHxTOPK (e.g. 8x4x2,16x5x4) to run beside the "
        "chains for eagle/mtp/draft_model drafters (default: none)",
    )
    sweep.add_argument(
        "--temperatures", default="0,1", help="comma-separated temperatures (default 0,1)"
    )
    sweep.add_argument(
        "--prompts-file",
        default=None,
        help='.jsonl of {"prompt": ...} user messages (default: the built-in workload)',
    )
    served = bench.add_argument_group(
        "serving benchmark (--serve or --url): a server under load, its own flags "
        "(`specdec bench --serve --help`)"
    )
    served.add_argument(
        "--serve",
        nargs="?",
        metavar="MODEL",
        help="start `specdec serve MODEL` (no MODEL: the built-in one) and drive it at several "
        "concurrencies or request rates: requests/s, tokens/s, TTFT / TPOT / ITL percentiles, "
        "with and without speculation, beside LLM.generate (JSON, markdown, plot)",
    )
    served.add_argument("--url", help="drive a server that is already running instead")
    add_engine_arguments(bench)
    add_threads_flag(bench)
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec import bench
    from specdec.cli.flags import check_before_loading, engine_kwargs, speculative_config
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    if args.sweep:
        return _bench_sweep(args)
    spec = speculative_config(args, default_spec(args.model, args.device))
    check_before_loading(EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)), spec)
    plain = LLM(args.model, speculative_config=None, **engine_kwargs(args))
    if plain.engine.config.warm_up:  # graphs (the CPU loop) before the timed work
        plain.engine.warm_up()
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
    plain.close()  # stops tensor-parallel workers before the next engine starts
    del plain
    spec_llm = LLM(args.model, speculative_config=spec, **engine_kwargs(args))
    if spec_llm.engine.config.warm_up:
        spec_llm.engine.warm_up()
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
        "command": _command_line(args),
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
    from specdec.cli.flags import check_before_loading, engine_kwargs
    from specdec.engine.config import EngineConfig
    from specdec.models import Tokenizer, default_model_path, load_model

    trees = bench.parse_trees(args.trees)  # bad settings are refused before a model loads
    check_before_loading(EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)))
    drafters = {}
    for item in args.drafter:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--drafter expects NAME=JSON, got {item!r}")
        try:
            drafters[name] = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--drafter {name}: not valid JSON ({err.msg}): {text!r}") from None
    if not drafters:
        shipped = default_spec(args.model, args.device)
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
        trees=trees,
    )
    table = bench.sweep_table(points)
    print(table)
    meta = {
        "title": f"specdec bench --sweep: {args.model or 'SmolLM2-135M-Instruct'}",
        "machine": bench.machine_description(),
        "date": time.strftime("%Y-%m-%d"),
        "command": _command_line(args),
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "drafters": drafters,
        "trees": args.trees,
        "table": table,
    }
    png = bench.write_sweep(Path(args.out), points, meta)
    print(f"wrote {args.out} and {png}")
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed (for the JSON record): `specdec bench ...`."""
    import shlex

    return "specdec " + shlex.join(args.argv)
