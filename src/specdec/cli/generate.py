"""`specdec generate`: one prompt, streamed, then the acceptance figures."""

from __future__ import annotations

import argparse
import sys
import time

from specdec.cli.flags import DEFAULT_SPECULATIVE_CONFIG, default_spec

GENERATE_MAX_TOKENS = 256


def add_generate(commands) -> None:
    from specdec.cli.flags import add_engine_arguments, add_sampling_arguments

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


def _generate(args: argparse.Namespace) -> int:
    from specdec.cli.flags import engine_kwargs, sampling_params, speculative_config
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
