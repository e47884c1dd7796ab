"""The ``flodl`` console script (also ``python -m flodl``).

The only module that configures logging. Each subcommand registers itself in
:func:`build_parser` and returns a process exit status.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

import flodl

__all__ = ["build_parser", "main"]

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="flodl",
        description=(
            "flodl trains one PyTorch model data-parallel across ranks of unequal speed that "
            "may die mid-run: per-rank batch counts per averaging window (ElChe cadence), "
            "speed-proportional data dispatch, work-weighted parameter averaging."
        ),
    )
    parser.add_argument("--version", action="version", version=f"flodl {flodl.__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-v info, -vv debug)"
    )
    parser.set_defaults(command=None)
    parser.add_subparsers(title="commands", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(int(args.verbose), 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command: Command | None = args.command
    if command is None:
        parser.print_help()
        return 0
    return command(args)


if __name__ == "__main__":  # pragma: no cover - python -m flodl.cli
    sys.exit(main())
