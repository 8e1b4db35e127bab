"""The `specdec` command line: one subcommand per task (`generate`, `bench`, `serve`, `audit`,
`train-drafter`), one module per subcommand; flags are derived from the config classes (`flags`).

Parses arguments and prints results; the work itself lives in the library (`specdec.audit`
for the audit), so that tests run exactly what the command runs. A user error (a bad flag, a
value the configs refuse, a missing file, a busy port) is one line on stderr,
`specdec COMMAND: error: ...`, and exit status 2; SPECDEC_TRACEBACK=1 shows the traceback too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Sequence

from specdec import __version__
from specdec.cli.audit import add_audit
from specdec.cli.bench import add_bench
from specdec.cli.flags import DEFAULT_SPECULATIVE_CONFIG, choose_model, default_spec
from specdec.cli.generate import add_generate
from specdec.cli.serve import add_serve
from specdec.cli.train import add_train_drafter

__all__ = ["DEFAULT_SPECULATIVE_CONFIG", "Parser", "build_parser", "default_spec", "main"]

# Errors a user causes (their messages name what to fix): reported in one line, exit status 2.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, OSError)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: `prog: error: message`, exit status 2.

    `intermixed=True`: positionals may come between options (`generate MODEL --max-tokens 8
    PROMPT`), which argparse's own parse splits wrongly when an optional positional precedes
    a required one. After parsing, the model named by a positional or `--model` becomes
    `args.model` (`choose_model`).
    """

    def __init__(self, *args, intermixed: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._parsing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._parsing:  # a pass of parse_known_intermixed_args
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            if self.intermixed:
                namespace, extras = self.parse_known_intermixed_args(args, namespace)
            else:
                namespace, extras = super().parse_known_args(args, namespace)
        finally:
            self._parsing = False
        try:
            choose_model(namespace)
        except ValueError as err:
            self.error(str(err))
        return namespace, extras

    def error(self, message: str) -> None:  # type: ignore[override]
        report(self.prog, message)
        sys.exit(2)


def report(prog: str, message: str) -> None:
    """Prints `prog: error: message` on one line of stderr (newlines folded)."""
    text = " ".join(str(message).split())
    sys.stderr.write(f"{prog}: error: {text}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subparser per subcommand."""
    parser = Parser(
        prog="specdec",
        description="An LLM inference engine whose speculative decoding is exact and reproducible.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate(commands)
    add_bench(commands)
    add_serve(commands)
    add_train_drafter(commands)

    add_audit(commands)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(f"specdec: warning: {' '.join(str(message).split())}\n")


def serving_bench(argv: Sequence[str]) -> bool:
    """Whether `argv` asks for the serving benchmark: `bench` with `--serve` or `--url`, whose
    flags are its own (`specdec.bench_serve`)."""
    named = [arg.split("=", 1)[0] for arg in argv[1:]]
    return argv[:1] == ["bench"] and ("--serve" in named or "--url" in named)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `specdec` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if serving_bench(argv):
        from specdec.bench_serve import main as bench_serve

        return _reporting("specdec bench", lambda: bench_serve(argv[1:], prog="specdec bench"))
    args, unknown = build_parser().parse_known_args(argv)
    prog = f"specdec {args.command}"
    if unknown:
        report(prog, f"unrecognized arguments: {' '.join(unknown)} (see {prog} --help)")
        return 2
    args.argv = argv  # as typed, for records of the command (bench's JSON)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _reporting(prog, lambda: args.handler(args))
    finally:
        torch.set_num_threads(threads)  # for callers of main() in this process (tests)


def _reporting(prog: str, work) -> int:
    """Runs `work()` and returns its exit status; a user's error is one line (status 2)."""
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        return work()
    except USER_ERRORS as err:
        if os.environ.get("SPECDEC_TRACEBACK"):
            traceback.print_exc()
        report(prog, str(err) or type(err).__name__)
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
