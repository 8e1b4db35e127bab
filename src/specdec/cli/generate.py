"""`specdec generate`: one prompt, streamed, then the acceptance figures."""

from __future__ import annotations

import argparse
import sys
import time

from specdec.cli.flags import default_spec, default_spec_help

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
        "SmolLM2-135M-Instruct), streaming the text as it is produced. "
        f"Default speculation: {default_spec_help()}. With --n > 1 the samples are printed "
        "one after the other once all are done; --logprobs prints each token's log-probability "
        "(and the top alternatives) on stderr. Every flag is checked before the model loads.",
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
    # A whole answer rather than SamplingParams' 16-token default (it still stops at EOS).
    add_sampling_arguments(generate, max_tokens=GENERATE_MAX_TOKENS)
    add_structured_arguments(generate)
    add_engine_arguments(generate)
    add_threads_flag(generate)
    generate.set_defaults(handler=_generate)


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
    spec = None if args.no_spec else speculative_config(args, default_spec(args.model, args.device))
    check_before_loading(EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)), spec)
    llm = _load(args.model, spec, engine_kwargs(args))
    printed = [0]

    def stream(output) -> None:
        text = output.outputs[0].text
        sys.stdout.write(text[printed[0] :])
        sys.stdout.flush()
        printed[0] = len(text)

    started = time.perf_counter()
    use_chat = not args.no_chat and llm.tokenizer is not None and llm.tokenizer.chat_template
    on_tokens = stream if params.n == 1 else None
    if use_chat:
        messages = [{"role": "user", "content": args.prompt}]
        outputs = llm.chat(messages, params, on_tokens=on_tokens, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, on_tokens=on_tokens, use_tqdm=False)
    elapsed = time.perf_counter() - started
    out = outputs[0]
    if params.n > 1:
        for completion in out.outputs:
            print(f"--- sample {completion.index} ({completion.finish_reason}) ---")
            print(completion.text)
    else:
        print()
    if params.logprobs is not None:
        for completion in out.outputs:
            _print_logprobs(completion, params.logprobs)
    completion = out.outputs[0]
    num_tokens = sum(len(c.token_ids) for c in out.outputs)
    stats = out.spec_decode_stats
    print(
        f"\n[{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s), "
        f"finish: {', '.join(str(c.finish_reason) for c in out.outputs)}, seed: {out.seed}]",
        file=sys.stderr,
    )
    for c in out.outputs:
        if c.error is not None:
            print(f"[sample {c.index}: {c.error}]", file=sys.stderr)
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


def _load(model: str | None, spec, engine_args: dict):
    """The LLM, with a line on stderr while it loads (it takes seconds)."""
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
        f"max_model_len {engine.max_model_len})\n"
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
