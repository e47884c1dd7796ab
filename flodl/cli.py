"""The ``flodl`` console script (also ``python -m flodl``).

The only module that configures logging. Each subcommand registers itself in
:func:`build_parser` and returns a process exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

import flodl
from flodl.config import MODES
from flodl.errors import ConfigError

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
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_sim(sub)
    return parser


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sim",
        help="predict each mode's wall time, idle and syncs for a rig (simulated, no GPUs)",
        description=(
            "Capacity planning: simulate the real coordinator with ranks of the given relative "
            "speeds and print each mode side by side, against the fastest rank training alone."
        ),
    )
    p.add_argument("--speeds", required=True, help="relative ms per batch per rank, e.g. 1,1,3")
    p.add_argument("--base-ms", type=float, default=10.0, help="ms per batch of speed 1")
    p.add_argument("--dataset-len", type=int, default=50_000, help="samples per epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--reduce-ms", type=float, default=5.0, help="duration of one averaging")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to compare")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(command=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from flodl.sim.plan import RigPlan, format_plan, parse_speeds, plan_modes

    try:
        modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            raise ConfigError(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
        for name in ("base_ms", "reduce_ms"):
            value = getattr(args, name)
            if not (value >= 0 and value < float("inf")) or (name == "base_ms" and value == 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number > 0")
        for name in ("dataset_len", "batch_size", "epochs"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        rig = RigPlan(
            speeds=parse_speeds(args.speeds),
            base_ms=args.base_ms,
            dataset_len=args.dataset_len,
            batch_size=args.batch_size,
            epochs=args.epochs,
            reduce_ms=args.reduce_ms,
            seed=args.seed,
        )
        traces = plan_modes(rig, modes)
    except ConfigError as exc:
        print(f"flodl sim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({m: t.summary() for m, t in traces.items()}, indent=2))
    else:
        print(format_plan(rig, traces))
    return 0


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
