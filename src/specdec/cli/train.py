"""`specdec train-drafter`: distil a drafter from the target, or (`--export`) write an EAGLE
head in a public format."""

from __future__ import annotations

import argparse
import sys

from specdec.cli.flags import add_config_flags, config_values

# Training settings that are flags of `train-drafter` (kind, data, out, target, resume and
# gen_temperatures have flags of their own).
OPTION_FLAGS = (
    "seed",
    "max_steps",
    "batch_size",
    "seq_len",
    "lr",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "checkpoint_every",
)
RUN_FLAGS = (
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
)


HEAD_FORMATS = ("specdec", "eagle", "eagle3")  # `specdec.train.kinds.eagle.HEAD_FORMATS`


def add_train_drafter(commands) -> None:
    from specdec.cli.flags import MODEL_HELP, add_threads_flag
    from specdec.train.kind import TrainOptions
    from specdec.train.trainer import TrainConfig

    run = TrainConfig(kind="", data=(), out="")
    train = commands.add_parser(
        "train-drafter",
        help="train a drafter (draft_model, eagle/mtp, ...) by distillation from the target",
        description="Distil a drafter from the target: annotate the data with the target's hidden "
        "features (self-distillation: the target's own answers to .jsonl chat prompts; or text "
        "files), train with a progress bar, checkpoint every --checkpoint-every steps (resume "
        "with --resume), then measure held-out acceptance at K=--eval-k through the engine. "
        'DIR then holds config.json + model.safetensors: speculative_config={"method": KIND, '
        '"model": DIR}. With --export SRC, nothing is trained: the EAGLE head in SRC is written '
        "to DIR in --format (eagle: the EAGLE-1/2 layout vLLM's method eagle loads; eagle3: an "
        "EAGLE-3 head as vLLM's and SGLang's EAGLE-3 loaders both read it), or refused naming "
        "what that format cannot hold exactly.",
    )
    train.add_argument(
        "--target",
        dest="model",
        metavar="MODEL",
        default=None,
        help=f"the target model to distil from: {MODEL_HELP}",
    )
    train.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        default=None,
        help="the same as --target (the name the other commands give the model)",
    )
    train.add_argument(
        "--kind", default=None, help="draft_model, eagle, mtp, ... (required unless --export)"
    )
    train.add_argument(
        "--data",
        action="append",
        default=None,
        help=".jsonl prompts, text file or folder, or an earlier run's train-tokens.pt (pooled; "
        "required unless --export)",
    )
    train.add_argument("--out", required=True, help="output directory DIR")
    train.add_argument(
        "--format",
        dest="head_format",
        choices=HEAD_FORMATS,
        default="specdec",
        help="the directory an eagle/mtp head is written as: specdec (ours: fc over normed "
        "features, input/layer/output norms) or eagle (trains the EAGLE-1/2 layout over the "
        "target's last layer, full vocabulary, and writes it as vLLM's method eagle and "
        "SafeAILab's EAGLE load it); eagle3 only with --export (an EAGLE-3 head rewritten as "
        "vLLM and SGLang load it; the heads trained here are another network, refused) "
        "(default: specdec)",
    )
    train.add_argument(
        "--export",
        metavar="SRC",
        default=None,
        help="train nothing: write the EAGLE head in SRC (any format speculative_config loads) "
        "to DIR in --format eagle or eagle3, for --target; refused, naming each difference, when "
        "the head is not exactly that layout (heads trained with --format specdec never are; "
        "eagle3 takes EAGLE-3 heads only)",
    )
    train.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    train.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="kind-specific setting (e.g. draft_vocab_size=8192, ttt_steps=3, draft_layers=2)",
    )
    add_config_flags(train, TrainOptions, OPTION_FLAGS)
    add_config_flags(train, TrainConfig, RUN_FLAGS)
    train.add_argument(
        "--gen-temperatures",
        default=",".join(str(t) for t in run.gen_temperatures),
        help="comma-separated; prompt i is answered at temperature i mod len "
        f"(default: {','.join(str(t) for t in run.gen_temperatures)})",
    )
    add_threads_flag(train)
    train.set_defaults(handler=_train_drafter)


def _train_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.models.loader import missing_model_message
    from specdec.train.kind import TrainOptions
    from specdec.train.trainer import TrainConfig, train_drafter

    if args.model is not None and not Path(args.model).exists():
        raise FileNotFoundError(missing_model_message(args.model))
    if args.export is not None:
        return _export(args)
    if args.head_format == "eagle3":
        from specdec.drafters.eagle.export_eagle3 import EAGLE_HEAD_REASON

        raise ValueError(
            f"--format eagle3 is not trained here: {EAGLE_HEAD_REASON} (--export SRC --format "
            "eagle3 rewrites an EAGLE-3 checkpoint)"
        )
    missing = [flag for flag, value in (("--kind", args.kind), ("--data", args.data)) if not value]
    if missing:
        raise ValueError(f"train-drafter needs {' and '.join(missing)} (or --export SRC)")
    extra = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option expects KEY=VALUE, got {item!r}")
        extra[key] = value
    if args.head_format != "specdec":
        extra["format"] = args.head_format
    options = TrainOptions(**config_values(args, TrainOptions, OPTION_FLAGS), extra=extra)
    config = TrainConfig(
        kind=args.kind,
        data=tuple(args.data),
        out=args.out,
        target=args.model,
        options=options,
        resume=args.resume,
        **config_values(args, TrainConfig, RUN_FLAGS),
        gen_temperatures=tuple(float(x) for x in args.gen_temperatures.split(",")),
    )
    train_drafter(config, log=lambda message: print(message, file=sys.stderr, flush=True))
    return 0


def _export(args: argparse.Namespace) -> int:
    """`--export SRC`: the head in SRC written to --out in --format."""
    from specdec.drafters.eagle.export import export_head
    from specdec.models import load_model

    if args.head_format == "specdec":
        raise ValueError("--export writes a public format: give --format eagle or eagle3")
    if args.model is None:
        raise ValueError("--export needs --target (the model the head drafts for)")
    target = load_model(args.model).model
    out = export_head(args.export, args.out, args.head_format, target)
    print(f"wrote {out} ({args.head_format})", file=sys.stderr, flush=True)
    return 0
