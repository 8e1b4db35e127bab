"""`specdec train-drafter`: distil a drafter from the target."""

from __future__ import annotations

import argparse
import sys


def add_train_drafter(commands) -> None:
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
