"""``flodl sim``: plan a rig from typed speeds (``--speeds``), or replay a run's record log and
ask it what-ifs (``--from-records DIR``). The entry layer over :mod:`flodl.sim.plan` and
:mod:`flodl.sim.replay` (docs/design.md §3)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from flodl.config import DEFAULT_BATCH_SIZE, MODES
from flodl.errors import ConfigError

__all__ = ["add_sim"]


def add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``flodl sim``."""
    p = sub.add_parser(
        "sim",
        help="predict each mode's wall time for a rig, or replay a run's records (simulated)",
        description=(
            "Capacity planning with the real coordinator. --speeds: ranks of the given relative "
            "speeds, each mode side by side against the fastest rank alone. --from-records DIR: "
            "replay a finished or running job's record log, report the replay's error against "
            "the recorded run, then what-ifs (other modes, each rank dropped; or the ones asked)."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--speeds", help="relative ms per batch per rank, e.g. 1,1,3")
    src.add_argument("--from-records", metavar="DIR", help="a run's record_log directory")
    p.add_argument("--base-ms", type=float, default=10.0, help="--speeds: ms per batch of 1")
    p.add_argument("--dataset-len", type=int, default=50_000, help="--speeds: samples/epoch")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--reduce-ms", type=float, default=5.0, help="--speeds: one averaging, ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes (--speeds: to compare, default all; --from-records: "
        "what-ifs in these modes)",
    )
    w = p.add_argument_group("what-ifs (--from-records)")
    w.add_argument(
        "--add-rank", type=float, action="append", default=[], metavar="MS",
        help="add a rank of this many ms per batch (repeatable)",
    )  # fmt: skip
    w.add_argument(
        "--drop-rank", type=int, action="append", default=[], metavar="N",
        help="leave rank N out (repeatable)",
    )  # fmt: skip
    w.add_argument("--failures-per-hour", type=float, default=None, metavar="F")
    w.add_argument(
        "--restart-s", type=float, default=None, metavar="S",
        help="a failed rank's or job's time to come back (default 30)",
    )  # fmt: skip
    w.add_argument("--overhead-target", type=float, default=None)
    w.add_argument("--max-anchor", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(command=_run_sim)


def _modes(text: str | None) -> list[str]:
    if text is None:
        return list(MODES)
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    return modes


def _run_sim(args: argparse.Namespace) -> int:
    try:
        if args.from_records is not None:
            return _replay(args)
        return _plan(args)
    except ConfigError as exc:
        print(f"flodl sim: error: {exc}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from flodl.sim.plan import (
        RigPlan,
        format_plan,
        lockstep_s,
        lockstep_steps,
        parse_speeds,
        plan_modes,
    )

    asked = [
        n
        for n in ("add_rank", "drop_rank", "failures_per_hour", "restart_s", "overhead_target")
        if getattr(args, n) not in (None, [])
    ]
    if asked or args.max_anchor is not None:
        name = (asked or ["max_anchor"])[0].replace("_", "-")
        raise ConfigError(f"--{name} is a what-if of --from-records, not of --speeds")
    modes = _modes(args.modes)
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
    if args.json:
        out: dict[str, Any] = {m: t.summary() for m, t in traces.items()}
        out["ddp_lockstep"] = {"wall_s": lockstep_s(rig), "syncs": lockstep_steps(rig)}
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(rig, traces))
    return 0


def _asked(args: argparse.Namespace, world: int) -> list[Any]:
    """The what-ifs the options ask for: one per option, then all of them together."""
    from flodl.sim.replay import WhatIf

    asked: list[WhatIf] = []
    if args.modes is not None:
        asked += [WhatIf(name=m, mode=m) for m in _modes(args.modes)]
    for ms in args.add_rank:
        if not (ms > 0 and math.isfinite(ms)):
            raise ConfigError(f"--add-rank {ms}: expected ms per batch > 0")
        asked.append(WhatIf(name=f"add a {ms:g} ms rank", add_ms=(ms,)))
    for r in args.drop_rank:
        if not 0 <= r < world:
            raise ConfigError(f"--drop-rank {r}: the run has ranks 0..{world - 1}")
        asked.append(WhatIf(name=f"drop rank {r}", drop=(r,)))
    if args.overhead_target is not None:
        if not 0.01 <= args.overhead_target <= 0.5:
            raise ConfigError(f"--overhead-target {args.overhead_target}: expected 0.01..0.5")
        name = f"overhead target {args.overhead_target:g}"
        asked.append(WhatIf(name=name, elche={"overhead_target": args.overhead_target}))
    if args.max_anchor is not None:
        if args.max_anchor < 1:
            raise ConfigError(f"--max-anchor {args.max_anchor}: expected >= 1")
        name = f"max anchor {args.max_anchor}"
        asked.append(WhatIf(name=name, elche={"max_anchor": args.max_anchor}))
    if len(asked) > 1:
        single_mode = [w.mode for w in asked if w.mode]
        asked.append(
            WhatIf(
                name="all of the above",
                mode=single_mode[0] if len(single_mode) == 1 else None,
                add_ms=tuple(ms for w in asked for ms in w.add_ms),
                drop=tuple(r for w in asked for r in w.drop),
                elche={k: v for w in asked for k, v in w.elche.items()},
            )
        )
    return asked


def _replay(args: argparse.Namespace) -> int:
    from flodl.monitor.records import read_tree
    from flodl.sim.replay import (
        DEFAULT_RESTART_S,
        compare,
        failure_goodput,
        format_replay,
        recorded_run,
        what_ifs,
    )

    run = recorded_run(read_tree(args.from_records))
    asked = _asked(args, run.world_size)
    if args.restart_s is not None and args.failures_per_hour is None:
        raise ConfigError("--restart-s goes with --failures-per-hour")
    rows = what_ifs(run, asked, seed=args.seed)
    error = compare(run, rows[0][1])
    goodput = None
    if args.failures_per_hour is not None:
        restart = DEFAULT_RESTART_S if args.restart_s is None else args.restart_s
        goodput = failure_goodput(
            run, rows[0][1], args.failures_per_hour, restart_s=restart, seed=args.seed
        )
    if not args.json:
        print(format_replay(run, error, rows, goodput))
        return 0
    base = rows[0][1]
    base_s = base.epoch_at[-1] if base.epoch_at else base.wall_s
    out = {
        "recorded": {
            "mode": run.mode,
            "world_size": run.world_size,
            "dataset_len": run.dataset_len,
            "batch_size": run.batch_size,
            "epochs": run.epochs,
            "median_ms_per_batch": [run.median_ms(r) for r in range(run.world_size)],
            "averaging_ms": run.averaging_ms,
            "callback_ms_per_epoch": run.callback_ms_per_epoch,
            "rank_failures": sum(f.kind == "kill" for f in run.faults),
            "unknown_speed": list(run.unknown_speed),
        },
        "error": error,
        "what_ifs": [
            {
                "name": w.name,
                "mode": w.mode or run.mode,
                "training_s": round(t.epoch_at[-1] if t.epoch_at else t.wall_s, 3),
                "vs_replay": round((t.epoch_at[-1] if t.epoch_at else t.wall_s) / base_s, 4)
                if base_s
                else None,
                "syncs": t.cycles,
                "samples": t.samples,
                "ok": t.ok,
            }
            for w, t in rows
        ],
        "goodput": goodput,
        "advice": list(run.advice),
    }
    print(json.dumps(out, indent=2))
    return 0
