"""The `specdec` command line: one subcommand per task (`generate`, `bench`, `serve`, `audit`,
`train-drafter`), one module per subcommand; flags are derived from the config classes (`flags`).

Parses arguments and prints results; the work itself lives in the library (`specdec.audit`
for the audit), so that tests run exactly what the command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdec import __version__
from specdec.cli.audit import add_audit
from specdec.cli.bench import add_bench
from specdec.cli.flags import DEFAULT_SPECULATIVE_CONFIG, default_spec
from specdec.cli.generate import add_generate
from specdec.cli.serve import add_serve
from specdec.cli.train import add_train_drafter

__all__ = ["DEFAULT_SPECULATIVE_CONFIG", "build_parser", "default_spec", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subparser per subcommand."""
    parser = argparse.ArgumentParser(
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `specdec` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
