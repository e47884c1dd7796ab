"""The ``flodl`` console script (also ``python -m flodl``).

The only module that configures logging. Each subcommand registers itself in
:func:`build_parser` and returns a process exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import flodl
from flodl.config import MODES
from flodl.errors import ConfigError
from flodl.sim_cli import add_sim
from flodl.timeouts import DEFAULT_HEARTBEAT_TIMEOUT_S

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
    _add_coord(sub)
    _add_launch(sub)
    add_sim(sub)
    _add_records(sub)
    _add_dashboard(sub)
    _add_chaos(sub)
    _add_demo(sub)
    return parser


def _add_coord(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "coord",
        help="run a standalone coordinator that ranks started by torchrun, srun or ssh join",
        description=(
            "Run one job's coordinator alone. Ranks join with FLODL_COORD=host:port, "
            "FLODL_SECRET_FILE (or FLODL_SECRET, hex), FLODL_RUN_ID, and their rank/world from "
            "FLODL_RANK/FLODL_WORLD_SIZE, torchrun's RANK/WORLD_SIZE or SLURM's "
            "SLURM_PROCID/SLURM_NTASKS. The ranks bring the job (dataset, batch size, epochs, "
            "mode, callbacks, outer optimizer): `flodl coord --world-size N --secret-file F` "
            "is enough."
        ),
    )
    p.add_argument(
        "--world-size",
        type=int,
        help="ranks of the run (the same as --min-world-size N --max-world-size N)",
    )
    p.add_argument(
        "--min-world-size",
        type=int,
        help="start training once this many ranks joined (default: --max-world-size)",
    )
    p.add_argument(
        "--max-world-size",
        type=int,
        help="admit up to this many ranks (ids 0..N-1, FLODL_WORLD_SIZE=N on every rank); "
        "ranks that come after the start, or restart, join the running run",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    p.add_argument(
        "--data-port",
        type=int,
        default=0,
        help="the data port: the CPU reduce server's (CPU modes) or the torch.distributed "
        "store's (collective modes); 0: any free port (fix it where a firewall or a "
        "Kubernetes Service must name it)",
    )
    p.add_argument(
        "--secret-file",
        required=True,
        help="run secret (hex); created with mode 0600 if missing, refused if group/world-readable",
    )
    p.add_argument(
        "--run-id",
        help="the run's id (default: a fresh random one, printed for the ranks' FLODL_RUN_ID): "
        "frames recorded from another run with the same secret are refused by it",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds of silence after which a rank is declared dead, before "
        "FLODL_NET_TIMEOUT_SCALE; every other deadline derives from it and ranks obey it",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="segments after a stop: when every rank is lost (torchrun restarting its worker "
        "group), wait on the same port for the ranks to come back and resume from the last "
        "bundle, up to N times (default 0: a stop ends the coordinator)",
    )
    p.add_argument("--save-path", help="bundle stem for the meta (default: the ranks' save_path)")
    p.add_argument("--resume-from", help="bundle stem to resume from (default: the ranks')")
    job = p.add_argument_group(
        "job assertions",
        "The ranks bring the job: the first rank's defines it, every later rank must match. "
        "Each option given here is checked against it; a rank that differs is refused with "
        "the field and both values.",
    )
    job.add_argument("--dataset-len", type=int, help="samples in the ranks' dataset")
    job.add_argument("--batch-size", type=int)
    job.add_argument("--epochs", type=int)
    job.add_argument("--mode", help=f"one of {', '.join(MODES)}")
    job.add_argument("--seed", type=int, help="shuffle seed (the ranks' `seed`)")
    job.add_argument("--checkpoint-every", type=int, help="a bundle every N epochs")
    job.add_argument("--checkpoint-fn", action="store_true", default=None, help="ranks set it")
    job.add_argument("--epoch-fn", action="store_true", default=None, help="ranks set epoch_fn")
    job.add_argument("--eval", action="store_true", default=None, help="ranks set eval_fn")
    job.add_argument("--eval-every", type=int, help="eval every N epochs")
    job.add_argument("--outer", help="outer optimizer: avg, slow_momentum:LR:MU or nesterov:LR:MU")
    p.set_defaults(command=_run_coord)


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script on the hosts and devices of an fdl.cluster.yml",
        description=(
            "Run COMMAND (your training script) as the launcher of the cluster described by "
            "--cluster: its Trainer.run() starts the coordinator and one rank per device, on "
            "this machine by local exec and on other hosts over ssh (BatchMode, with the "
            "file's port/user/identity). Each rank's output is prefixed with its rank; "
            "SIGINT/SIGTERM are forwarded."
        ),
    )
    p.add_argument("--cluster", required=True, help="path of the fdl.cluster.yml")
    p.add_argument(
        "--respawn",
        type=int,
        default=None,
        metavar="N",
        help="restart a rank process that fails, up to N times per rank, without restarting "
        "the others; it rejoins the run (overrides TrainerConfig.respawn)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- python train.py [args]")
    p.set_defaults(command=_run_launch)


def _trailing_command(args: argparse.Namespace, name: str) -> list[str] | None:
    """The command after ``--`` (``flodl launch|chaos … -- python train.py``); None, with the
    error printed, when there is none."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(f"flodl {name}: error: give the command to run after --", file=sys.stderr)
        return None
    return cmd


def _run_forwarding(name: str, cmd: list[str], env: dict[str, str]) -> int | None:
    """Run ``cmd`` to its end, forwarding SIGINT and SIGTERM to it (so stopping us never
    orphans it); its exit status, or None (the error printed) when it cannot start."""
    import signal
    import subprocess

    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        print(f"flodl {name}: error: cannot run {cmd[0]!r}: {exc}", file=sys.stderr)
        return None

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return child.wait()


def _run_launch(args: argparse.Namespace) -> int:
    import os

    from flodl.launch.cluster import CLUSTER_ENV_VAR
    from flodl.launch.cluster_file import load_cluster_yaml

    cmd = _trailing_command(args, "launch")
    if cmd is None:
        return 2
    try:
        cluster = load_cluster_yaml(args.cluster)
    except ConfigError as exc:
        print(f"flodl launch: error: {exc}", file=sys.stderr)
        return 2
    env = {**os.environ, CLUSTER_ENV_VAR: cluster.to_env_json(), "FLODL_PREFIX_OUTPUT": "1"}
    if args.respawn is not None:
        if not 0 <= args.respawn <= 1000:
            print(
                f"flodl launch: error: --respawn {args.respawn}: expected 0..1000", file=sys.stderr
            )
            return 2
        from flodl.launch.env import ENV_RESPAWN

        env[ENV_RESPAWN] = str(args.respawn)
    code = _run_forwarding("launch", cmd, env)
    return 2 if code is None else code


def _run_coord(args: argparse.Namespace) -> int:
    from flodl.coord_cli import run_coord

    return run_coord(args)


def _add_records(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("records", help="read a run's record log (record_log directory)")
    rsub = p.add_subparsers(dest="records_command", metavar="ACTION", required=True)
    tail = rsub.add_parser(
        "tail", help="print a node's last records, one JSON object a line (oldest first)"
    )
    tail.add_argument("dir", help="the record_log directory")
    tail.add_argument("--path", default="root", help="node path: root, root/rank0, root/host…")
    tail.add_argument("-n", type=int, default=20, help="how many records (default 20)")
    tail.set_defaults(command=_run_records_tail)
    paths = rsub.add_parser("paths", help="list the node paths of a record directory")
    paths.add_argument("dir")
    paths.set_defaults(command=_run_records_paths)


def _run_records_tail(args: argparse.Namespace) -> int:
    from flodl.monitor.records import RecordLog, paths, validate_path

    try:
        path = validate_path(args.path)
        known = paths(args.dir)
        if path not in known:
            raise ConfigError(f"no node {path!r} in {args.dir} (nodes: {', '.join(known)})")
        records = RecordLog.tail(args.dir, path, args.n)
    except ConfigError as exc:
        print(f"flodl records: error: {exc}", file=sys.stderr)
        return 2
    for rec in records:
        print(json.dumps(rec, separators=(",", ":")))
    return 0


def _run_records_paths(args: argparse.Namespace) -> int:
    from flodl.monitor.records import paths

    try:
        for path in paths(args.dir):
            print(path)
    except ConfigError as exc:
        print(f"flodl records: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_dashboard(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "dashboard",
        help="serve a saved record directory as a live dashboard, or save it as one HTML file",
    )
    p.add_argument("dir", help="the record_log directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--theme", choices=("light", "dark"))
    p.add_argument("--save", metavar="HTML", help="write a self-contained HTML file and exit")
    p.set_defaults(command=_run_dashboard)


def _run_dashboard(args: argparse.Namespace) -> int:
    import threading

    from flodl.monitor.archive import save_dashboard, serve_directory
    from flodl.monitor.records import read_tree

    try:
        if args.save:
            path = save_dashboard(args.save, read_tree(args.dir), theme=args.theme)
            print(f"flodl dashboard: wrote {path}")
            return 0
        server = serve_directory(args.dir, args.host, args.port, theme=args.theme)
    except (ConfigError, OSError) as exc:
        print(f"flodl dashboard: error: {exc}", file=sys.stderr)
        return 2
    print(f"flodl dashboard of {args.dir}: {server.url} (Ctrl-C to stop)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        return 130
    finally:
        server.stop()
    return 0


def _add_chaos(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="run a training command with seeded faults injected into its ranks",
        description=(
            "Run COMMAND (a script whose Trainer launches ranks) and inject --kills faults into "
            "distinct ranks, spaced by exponential gaps of mean --mtbf seconds of training, of "
            "the kinds --signals names (KILL; STOP and CONT make a stop-then-continue hang of "
            "--stop-s). Deterministic for a --seed. Each fault and the coordinator's recovery "
            "(t_detect: fault → declared dead; t_resume: fault → the survivors' next reduce) "
            "is written to the run's record log and printed as a table at the end."
        ),
    )
    p.add_argument("--kills", type=int, required=True, help="how many faults (distinct ranks)")
    p.add_argument("--mtbf", type=float, required=True, help="mean seconds between faults")
    p.add_argument("--signals", default="KILL", help="comma list of KILL, STOP, CONT")
    p.add_argument("--stop-s", type=float, default=2.0, help="how long a STOP lasts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, required=True, help="ranks the command launches")
    p.add_argument("--spare", default="", help="comma list of ranks never hit")
    p.add_argument("--records", help="record directory (default: a fresh temporary one)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- python train.py [args]")
    p.set_defaults(command=_run_chaos)


def _run_chaos(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from flodl.chaos import CHAOS_ENV, RECORD_DIR_ENV, ChaosPlan, recovery_table

    cmd = _trailing_command(args, "chaos")
    if cmd is None:
        return 2
    try:
        spare = [int(r) for r in args.spare.split(",") if r.strip()]
        plan = ChaosPlan.generate(
            world_size=args.world_size,
            kills=args.kills,
            mtbf_s=args.mtbf,
            seed=args.seed,
            signals=[s for s in args.signals.split(",") if s.strip()],
            stop_s=args.stop_s,
            spare=spare,
        )
    except (ConfigError, ValueError) as exc:
        print(f"flodl chaos: error: {exc}", file=sys.stderr)
        return 2
    records = args.records or tempfile.mkdtemp(prefix="flodl-chaos-")
    print(f"flodl chaos: seed {plan.seed}, records in {records}", flush=True)
    for f in plan.faults:
        extra = f" for {f.duration_s:g} s" if f.duration_s else ""
        print(f"  {f.kind} rank {f.rank} after {f.after_s:g} s of training{extra}", flush=True)
    env = {**os.environ, CHAOS_ENV: plan.to_env(), RECORD_DIR_ENV: records}
    code = _run_forwarding("chaos", cmd, env)
    if code is None:
        return 2
    try:
        rows = recovery_table(records)
    except ConfigError as exc:
        print(f"flodl chaos: no records to read ({exc})", file=sys.stderr)
        return code or 1

    def secs(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f}"

    print("\nfault                rank  step    t_detect_s  t_resume_s")
    for r in rows:
        step = "—" if r["step"] is None else str(r["step"])
        print(
            f"{r['fault']:<20} {r['rank']:>4}  {step:>6}  {secs(r['t_detect_s']):>10}  "
            f"{secs(r['t_resume_s']):>10}"
        )
    if not rows:
        print("(no fault fired: the run ended first)")
    print(f"flodl chaos: the command exited {code}", flush=True)
    return code


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # (nothing of flodl.demo here: it imports torch, which no other command's parser needs)
    p = sub.add_parser(
        "demo",
        help="train a character-level model on the stdlib's source: solo vs N unequal ranks",
        description=(
            "Train a small character-level language model on the Python standard library's "
            "own source (no download): first one rank alone (the baseline), then N local CPU "
            "ranks, some slowed to stand in for weaker GPUs, in the given mode; then print "
            "accuracy, wall time, batch shares, syncs and anchor side by side. Writes the "
            "record log, an HTML dashboard and a checkpoint under --out."
        ),
    )
    p.add_argument("--mode", default="cpu_cadence", help=f"one of {', '.join(MODES)}")
    p.add_argument("--ranks", type=int, default=2, help="local CPU ranks (default 2)")
    p.add_argument(
        "--slow",
        action="append",
        metavar="RANK:FACTOR",
        help="make RANK FACTOR times slower (repeatable or comma-separated; default 1:3; "
        "'none' for equal ranks)",
    )
    p.add_argument(
        "--epochs", type=int, default=None, help="epochs of both runs (default 3)"
    )  # (None: DemoOptions' default, DEFAULT_EPOCHS; tests/unit/test_cli.py pins the two)
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--seed", type=int, default=0, help="model and shuffle seed")
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the summary's figures there as JSON (its directory must exist)",
    )
    p.set_defaults(command=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from flodl.demo import DemoOptions, parse_slow, run_demo
    from flodl.demo.run import DEFAULT_EPOCHS, result_json
    from flodl.errors import FlodlError

    try:
        options = DemoOptions(
            mode=args.mode,
            ranks=args.ranks,
            slow={},
            epochs=DEFAULT_EPOCHS if args.epochs is None else args.epochs,
            out=args.out,
            seed=args.seed,
        )
        options.check()  # the rank count first: --slow is checked against it
        specs = args.slow if args.slow is not None else ["1:3"]
        if specs != ["none"]:
            options = dataclasses.replace(options, slow=parse_slow(specs, args.ranks))
        json_path = _demo_json_path(args.json)
    except ConfigError as exc:
        print(f"flodl demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_demo(options)
    except ConfigError as exc:
        print(f"flodl demo: error: {exc}", file=sys.stderr)
        return 2
    except FlodlError as exc:
        print(f"flodl demo: the run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if result is not None and json_path is not None:  # (None in a rank process)
        try:
            json_path.write_text(json.dumps(result_json(options, result), indent=2) + "\n")
        except OSError as exc:
            print(f"flodl demo: error: --json {json_path}: {exc}", file=sys.stderr)
            return 1
    return 0


def _demo_json_path(value: str | None) -> Path | None:
    """``--json``'s file, checked before anything runs.

    Raises:
        ConfigError: its directory does not exist, or it names a directory.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"--json {value}: is a directory (expected a file path)")
    parent = path.resolve().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"--json {value}: {parent} {what}")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--json {value}: directory {parent} is not writable")
    return path


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
