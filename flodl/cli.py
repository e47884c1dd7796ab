"""The ``flodl`` console script (also ``python -m flodl``).

The only module that configures logging. Each subcommand registers itself in
:func:`build_parser` and returns a process exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import flodl
from flodl.config import DEFAULT_BATCH_SIZE, MODES
from flodl.errors import ConfigError
from flodl.timeouts import DEFAULT_HEARTBEAT_TIMEOUT_S

if TYPE_CHECKING:
    from flodl.outer import OuterConfig
    from flodl.service.standalone import Assertion

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
    _add_sim(sub)
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


def coord_world_sizes(
    world: int | None, minimum: int | None, maximum: int | None
) -> tuple[int, int | None]:
    """``flodl coord``'s (world size, minimum world size) from ``--world-size`` or
    ``--min-world-size`` / ``--max-world-size``.

    Raises:
        ConfigError: none given, both forms given, or a minimum above the maximum.
    """
    from flodl.wire.frames import MAX_WORLD_SIZE

    if world is not None:
        if minimum is not None or maximum is not None:
            raise ConfigError(
                "give either --world-size N or --min-world-size M --max-world-size N, not both"
            )
        maximum = world
    if maximum is None:
        raise ConfigError("give --world-size N, or --max-world-size N (and --min-world-size M)")
    if not 1 <= maximum <= MAX_WORLD_SIZE:
        raise ConfigError(f"world_size {maximum} must be in 1..{MAX_WORLD_SIZE}")
    if minimum is not None and not 1 <= minimum <= maximum:
        raise ConfigError(f"--min-world-size {minimum} must be in 1..--max-world-size ({maximum})")
    return maximum, minimum


def parse_outer(text: str) -> OuterConfig:
    """``avg`` | ``slow_momentum:LR:MU`` | ``nesterov:LR:MU`` (LR, MU optional).

    Raises:
        ConfigError: an unknown kind or a bad number.
    """
    from flodl.config import validated
    from flodl.outer import OuterConfig

    kind, *nums = text.split(":")
    if kind not in ("avg", "slow_momentum", "nesterov") or len(nums) > 2:
        raise ConfigError(f"--outer {text!r}: expected avg, slow_momentum:LR:MU or nesterov:LR:MU")
    defaults = {"avg": (1.0, 0.0), "slow_momentum": (1.0, 0.9), "nesterov": (0.7, 0.9)}[kind]
    try:
        values = [float(v) for v in nums] + list(defaults[len(nums) :])
    except ValueError:
        raise ConfigError(f"--outer {text!r}: LR and MU must be numbers") from None
    return validated(OuterConfig, kind=kind, lr=values[0], mu=values[1])


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


def _load_or_create_secret(path: str) -> bytes:
    """The run secret from ``path`` (hex, mode 0600), created there if missing."""
    import os
    import secrets
    import stat

    if not os.path.exists(path):
        secret = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex() + "\n")
        return secret
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"--secret-file {path} has mode {oct(mode)}: run 'chmod 600 {path}' (it must not be "
            "readable by group or others)"
        )
    try:
        secret = bytes.fromhex(Path(path).read_text().strip())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--secret-file {path}: not a hex secret ({exc})") from None
    if len(secret) < 16:
        raise ConfigError(f"--secret-file {path}: the secret must be at least 16 bytes")
    return secret


def coord_assertions(args: argparse.Namespace) -> tuple[Assertion, ...]:
    """The job options given to ``flodl coord``, as assertions about the ranks' job.

    Raises:
        ConfigError: an unknown ``--mode`` or a bad ``--outer``.
    """
    from flodl.service.standalone import Assertion

    found: list[Assertion] = []
    for option, path, value in (
        ("--dataset-len", "dataset_len", args.dataset_len),
        ("--batch-size", "batch_size", args.batch_size),
        ("--epochs", "num_epochs", args.epochs),
        ("--seed", "seed", args.seed),
        ("--checkpoint-every", "checkpoint_every", args.checkpoint_every),
        ("--checkpoint-fn", "has_checkpoint_fn", args.checkpoint_fn),
        ("--epoch-fn", "has_epoch_fn", args.epoch_fn),
        ("--eval", "has_eval", args.eval),
        ("--eval-every", "eval_every", args.eval_every),
    ):
        if value is not None:
            found.append(Assertion(option, path, value, "" if value is True else str(value)))
    if args.mode is not None:
        if args.mode not in MODES:
            raise ConfigError(f"--mode {args.mode!r}: expected one of {', '.join(MODES)}")
        found.append(Assertion("--mode", "elche.mode", args.mode, args.mode))
    if args.outer is not None:
        found.append(Assertion("--outer", "outer", parse_outer(args.outer), args.outer))
    if args.save_path is not None:
        found.append(Assertion("--save-path", "save_bundles", True, args.save_path))
    return tuple(found)


def _run_coord(args: argparse.Namespace) -> int:
    from flodl.coord.effects import BundleRequested, WriteMeta
    from flodl.launch.env import timeout_scale
    from flodl.service.bundles import BundleWriter
    from flodl.service.coordinator import CoordinatorService
    from flodl.service.server import LoggingSink
    from flodl.service.standalone import DefinedJob, JobTerms
    from flodl.timeouts import Timeouts

    try:
        world, minimum = coord_world_sizes(
            args.world_size, args.min_world_size, args.max_world_size
        )
        if args.run_id is None:
            import secrets

            args.run_id = f"run-{secrets.token_hex(6)}"
        terms = JobTerms(
            world_size=world,
            min_world_size=minimum,
            run_id=args.run_id,
            timeouts=Timeouts.derive(args.heartbeat_timeout, timeout_scale()),
            asserted=coord_assertions(args),
            save_path=args.save_path,
            resume_from=args.resume_from,
        )
        for option, value in (("--port", args.port), ("--data-port", args.data_port)):
            if not 0 <= value <= 65_535:
                raise ConfigError(f"{option} {value} must be in 0..65535")
        if args.port and args.port == args.data_port:
            raise ConfigError(f"--port and --data-port are both {args.port}: give two ports")
        secret = _load_or_create_secret(args.secret_file)
    except ConfigError as exc:
        print(f"flodl coord: error: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"flodl coord: warning: listening on {args.host}: traffic is authenticated (HMAC) but "
            "not encrypted; tunnel it (ssh -L) across untrusted networks",
            file=sys.stderr,
        )

    async def serve() -> int:
        class CoordSink(LoggingSink):
            """Logged, plus the coordinator's part of bundles (once the job names the stem)."""

            bundles = BundleWriter(None)

            def write_meta(self, effect: WriteMeta) -> None:
                self.bundles.write_meta(effect)

            def bundle_requested(self, effect: BundleRequested) -> None:
                self.bundles.bundle_requested(effect)

        sink = CoordSink()

        def defined(job: DefinedJob) -> None:
            sink.bundles = BundleWriter(job.save_stem, service)
            print(f"flodl coordinator: {job.summary()}", flush=True)

        service = CoordinatorService(
            terms,
            secret,
            host=args.host,
            port=args.port,
            data_port=args.data_port,
            sink=sink,
            on_defined=defined,
        )
        port = await service.start()
        sizes = str(world) if minimum in (None, world) else f"{minimum} to {world}"
        print(
            f"flodl coordinator for run {terms.run_id!r} ({sizes} ranks; the first rank brings "
            f"the job) on {args.host}:{port}\n"
            f"ranks join with: FLODL_COORD={args.host}:{port} "
            f"FLODL_SECRET_FILE={args.secret_file} FLODL_RUN_ID={terms.run_id}",
            flush=True,
        )
        try:
            over = await service.wait()
        finally:
            await service.close()
        print(f"flodl coordinator: {over.reason}", flush=True)
        if over.save_reason is not None and over.save_reason != "graceful_shutdown":
            from flodl.handle import training_stopped

            stem = service.job.save_stem if service.job is not None else None
            stopped = training_stopped(
                over.save_reason,
                over.detail,
                stem,
                None,
                lambda stem: (
                    f"`flodl coord` with the same options and the ranks with "
                    f"resume_from={stem!r} (or `flodl coord ... --resume-from "
                    f"{shlex.quote(stem)}`)"
                ),
            )
            print(f"flodl coord: {stopped}", file=sys.stderr, flush=True)
        return 0 if over.ok else 1

    try:
        import uvloop

        return int(uvloop.run(serve()))
    except KeyboardInterrupt:
        return 130


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
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
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
    from flodl.demo.run import DEFAULT_EPOCHS

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
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="epochs of both runs")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--seed", type=int, default=0, help="model and shuffle seed")
    p.set_defaults(command=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from flodl.demo import DemoOptions, parse_slow, run_demo
    from flodl.errors import FlodlError

    try:
        options = DemoOptions(
            mode=args.mode,
            ranks=args.ranks,
            slow={},
            epochs=args.epochs,
            out=args.out,
            seed=args.seed,
        )
        options.check()  # the rank count first: --slow is checked against it
        specs = args.slow if args.slow is not None else ["1:3"]
        if specs != ["none"]:
            options = dataclasses.replace(options, slow=parse_slow(specs, args.ranks))
    except ConfigError as exc:
        print(f"flodl demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_demo(options)
    except ConfigError as exc:
        print(f"flodl demo: error: {exc}", file=sys.stderr)
        return 2
    except FlodlError as exc:
        print(f"flodl demo: the run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
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
