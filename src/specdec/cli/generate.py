"""`specdec generate`: one prompt, streamed, then its speed and what speculation bought
(acceptance, tokens per target forward; with --compare, the speed of plain decoding too)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.cli.flags import default_spec, default_spec_help

if TYPE_CHECKING:
    from specdec.engine.outputs import RequestOutput

GENERATE_MAX_TOKENS = 256


def add_generate(commands) -> None:
    from specdec.cli.flags import (
        add_engine_arguments,
        add_model_arguments,
        add_sampling_arguments,
        add_structured_arguments,
        add_threads_flag,
    )

    generate = commands.add_parser(
        "generate",
        intermixed=True,
        help="generate text for a prompt, streaming tokens, then print acceptance figures",
        description="Generate for one prompt with speculative decoding on the given model "
        "(`specdec generate [MODEL] PROMPT`, or --model; default: the built-in "
        "SmolLM2-135M-Instruct), streaming the text as it is produced, then print the run's "
        "speed and what speculation bought: acceptance figures and tokens per target forward "
        "(--compare: the speed of plain decoding too). "
        f"Default speculation: {default_spec_help()}. With --n > 1 the samples are printed "
        "one after the other once all are done; --logprobs prints each token's log-probability "
        "(and the top alternatives) on stderr. Every flag is checked before the model loads. "
        "On CUDA the engine first captures the CUDA graph of every step shape it may take "
        "(one line on stderr; --no-warm-up: capture each on first use instead).",
    )
    add_model_arguments(generate)
    generate.add_argument(
        "prompt",
        help="the prompt (a user message for chat models); given alone it is the prompt, "
        "after MODEL too",
    )
    generate.add_argument(
        "--no-chat", action="store_true", help="do not wrap the prompt in the chat template"
    )
    generate.add_argument("--no-spec", action="store_true", help="decode without speculation")
    generate.add_argument(
        "--compare",
        action="store_true",
        help="then run the same prompt with speculation off (same seed, same loaded model) and "
        "print both speeds and their ratio (the plain run comes second, with the model warm)",
    )
    # A whole answer rather than SamplingParams' 16-token default (it still stops at EOS).
    add_sampling_arguments(generate, max_tokens=GENERATE_MAX_TOKENS)
    add_structured_arguments(generate)
    add_engine_arguments(generate)
    add_threads_flag(generate)
    generate.set_defaults(handler=_generate)


@dataclass(frozen=True, slots=True)
class Run:
    """One generation: the request's output, its wall time and the target forwards it took."""

    output: RequestOutput
    elapsed_s: float
    num_forwards: int

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.output.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def _generate(args: argparse.Namespace) -> int:
    from specdec.cli.flags import (
        check_before_loading,
        engine_kwargs,
        sampling_params,
        speculative_config,
        structured_outputs,
    )
    from specdec.engine.config import EngineConfig

    # Every argument is checked before the model loads (which takes seconds).
    params = sampling_params(args, structured_outputs=structured_outputs(args))
    if args.compare and args.no_spec:
        raise ValueError("--compare runs speculation against plain decoding: drop --no-spec")
    spec = None if args.no_spec else speculative_config(args, default_spec(args.model, args.device))
    check_before_loading(EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)), spec)
    llm = _load(args.model, spec, engine_kwargs(args))
    try:
        if llm.engine.config.warm_up:
            # Every CUDA graph captured before the first token (skipped, silently, where none is).
            report = llm.engine.warm_up()
            if report.skipped is None:
                print(report.line(), file=sys.stderr, flush=True)
        printed = [0]

        def stream(output) -> None:
            text = output.outputs[0].text
            sys.stdout.write(text[printed[0] :])
            sys.stdout.flush()
            printed[0] = len(text)

        run = _run(llm, args, params, stream if params.n == 1 else None)
        out = run.output
        if params.n > 1:
            for completion in out.outputs:
                print(f"--- sample {completion.index} ({completion.finish_reason}) ---")
                print(completion.text)
        else:
            print()
        if params.logprobs is not None:
            for completion in out.outputs:
                _print_logprobs(completion, params.logprobs)
        print(
            f"\n[{run.num_tokens} tokens in {run.elapsed_s:.2f} s "
            f"({run.tokens_per_s:.1f} tokens/s), "
            f"finish: {', '.join(str(c.finish_reason) for c in out.outputs)}, seed: {out.seed}]",
            file=sys.stderr,
        )
        for c in out.outputs:
            if c.error is not None:
                print(f"[sample {c.index}: {c.error}]", file=sys.stderr)
        if spec is not None:
            print(f"[{_speculation_figures(run, spec)}]", file=sys.stderr)
        if args.compare:
            plain = _run(
                llm, args, dataclasses.replace(params, seed=out.seed), None, {"enabled": False}
            )
            print(f"[{_comparison(run, plain)}]", file=sys.stderr)
        return 0
    finally:
        llm.close()  # tensor-parallel workers stop and the group is left before exit


def _run(llm, args, params, on_tokens, speculative: dict | None = None) -> Run:
    """Generates for the prompt (in the chat template unless --no-chat or the model has none),
    counting the engine's steps: each runs the target once."""
    stats = llm.engine.loop_stats
    before = stats.num_sync_steps + stats.num_overlapped_steps + stats.num_device_rounds
    use_chat = not args.no_chat and llm.tokenizer is not None and llm.tokenizer.chat_template
    options = {"on_tokens": on_tokens, "use_tqdm": False, "speculative": speculative}
    started = time.perf_counter()
    if use_chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, **options)
    else:
        outputs = llm.generate(args.prompt, params, **options)
    elapsed = time.perf_counter() - started
    after = stats.num_sync_steps + stats.num_overlapped_steps + stats.num_device_rounds
    return Run(outputs[0], elapsed, after - before)


def _speculation_figures(run: Run, spec) -> str:
    """The acceptance figures and the tokens each target forward emitted (1 without
    speculation; rounds where the adaptive policy drafted nothing count too)."""
    from specdec.cli.describe import speculation_note

    stats = run.output.spec_decode_stats
    per_position = ", ".join(f"{rate:.2f}" for rate in stats["acceptance_per_position"])
    samples = len(run.output.outputs)
    per_forward = run.num_tokens / max(run.num_forwards, 1)
    rounds = stats["num_drafts"]
    return (
        f"speculation {speculation_note(spec)}: {per_forward:.2f} tokens per target forward "
        f"(plain decoding: {samples}; {run.num_tokens} tokens in {run.num_forwards} forwards"
        + (f" of {samples} samples" if samples > 1 else "")
        + f"), mean acceptance length {stats['mean_acceptance_length']:.2f} over {rounds} "
        f"drafting round{'' if rounds == 1 else 's'}, acceptance rate "
        f"{stats['acceptance_rate']:.2f}, per position {per_position or '-'}"
    )


def _comparison(spec_run: Run, plain_run: Run) -> str:
    """Both speeds and their ratio, and whether the tokens are the same (they must be for
    coupled or greedy verification)."""
    same = all(
        a.token_ids == b.token_ids
        for a, b in zip(spec_run.output.outputs, plain_run.output.outputs, strict=True)
    )
    return (
        f"speculation: {spec_run.tokens_per_s:.1f} tok/s, plain: {plain_run.tokens_per_s:.1f} "
        f"tok/s ({spec_run.tokens_per_s / plain_run.tokens_per_s:.2f}x); plain ran "
        f"{plain_run.num_tokens} tokens in {plain_run.elapsed_s:.2f} s, "
        + ("the same tokens" if same else "other tokens (same law: standard/block verification)")
    )


def _load(model: str | None, spec, engine_args: dict):
    """The LLM, with a line on stderr while it loads (it takes seconds) that ends with what
    runs: device, weight format, max_model_len and speculation."""
    from specdec.cli.describe import speculation_note, weights_note
    from specdec.engine.llm import LLM

    name = model or "the built-in SmolLM2-135M-Instruct"
    what = "" if spec is None else f" with {spec.method} speculation"
    sys.stderr.write(f"loading {name}{what} ...")
    sys.stderr.flush()
    started = time.perf_counter()
    try:
        llm = LLM(model, speculative_config=spec, **engine_args)
    except BaseException:
        sys.stderr.write("\n")
        raise
    engine = llm.engine
    sys.stderr.write(
        f" done in {time.perf_counter() - started:.1f} s ({engine.device.type}, "
        f"{weights_note(engine.model, model)}, max_model_len {engine.max_model_len}, "
        f"speculation {speculation_note(engine.speculative_config)})\n"
    )
    return llm


def _print_logprobs(completion, num_top: int) -> None:
    """One stderr line per generated token: its log-probability and rank, then the top ones."""
    print(f"[logprobs of sample {completion.index}]", file=sys.stderr)
    for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        chosen = entry[token]
        top = ", ".join(
            f"{v.decoded_token!r} {v.logprob:.3f}" for _, v in list(entry.items())[:num_top]
        )
        print(
            f"  {chosen.decoded_token!r} {chosen.logprob:.3f} (rank {chosen.rank})"
            + (f"  top: {top}" if num_top else ""),
            file=sys.stderr,
        )
