"""``flodl coord``: one job's coordinator alone (docs/design.md §2c).

The ranks bring the job (:mod:`flodl.service.standalone`); the command line gives what only a
scheduler knows (world sizes, run id, ports, deadlines, the secret's file) and, optionally,
assertions about the job. With ``--max-restarts N`` a stopped run (every rank lost, as when
torchrun restarts its whole worker group) is not the end: the coordinator waits, on the same
port, for the ranks to come back, and the first of them defines the next segment of the run,
which resumes from the last committed bundle.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import stat
import sys
from dataclasses import replace
from pathlib import Path

from flodl import checkpoint, coord
from flodl.config import MODES, OuterConfig, validated
from flodl.coord.effects import BundleRequested, WriteMeta
from flodl.errors import CheckpointError, ConfigError
from flodl.launch import crash_trace
from flodl.launch.env import timeout_scale
from flodl.service.bundles import BundleWriter, read_bundle
from flodl.service.coordinator import CoordinatorService
from flodl.service.server import LoggingSink
from flodl.service.standalone import Assertion, DefinedJob, JobTerms
from flodl.timeouts import Timeouts
from flodl.wire.frames import MAX_WORLD_SIZE

__all__ = ["run_coord", "coord_world_sizes", "coord_assertions", "parse_outer"]


def coord_world_sizes(
    world: int | None, minimum: int | None, maximum: int | None
) -> tuple[int, int | None]:
    """``flodl coord``'s (world size, minimum world size) from ``--world-size`` or
    ``--min-world-size`` / ``--max-world-size``.

    Raises:
        ConfigError: none given, both forms given, or a minimum above the maximum.
    """
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
    kind, *nums = text.split(":")
    if kind not in ("avg", "slow_momentum", "nesterov") or len(nums) > 2:
        raise ConfigError(f"--outer {text!r}: expected avg, slow_momentum:LR:MU or nesterov:LR:MU")
    defaults = {"avg": (1.0, 0.0), "slow_momentum": (1.0, 0.9), "nesterov": (0.7, 0.9)}[kind]
    try:
        values = [float(v) for v in nums] + list(defaults[len(nums) :])
    except ValueError:
        raise ConfigError(f"--outer {text!r}: LR and MU must be numbers") from None
    return validated(OuterConfig, kind=kind, lr=values[0], mu=values[1])


def _load_or_create_secret(path: str) -> bytes:
    """The run secret from ``path`` (hex, mode 0600), created there if missing."""
    if not os.path.exists(path):
        secret = secrets.token_bytes(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secret.hex() + "\n")
        except OSError as exc:
            raise ConfigError(
                f"--secret-file {path} does not exist and cannot be created ({exc.strerror}): "
                "give the path of an existing secret file, or a writable place for a new one"
            ) from None
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


def run_coord(args: argparse.Namespace) -> int:
    """``flodl coord``'s exit status: 0 when the run completed, 1 when it stopped, 2 for bad
    options."""
    try:
        world, minimum = coord_world_sizes(
            args.world_size, args.min_world_size, args.max_world_size
        )
        if args.run_id is None:
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
        if not 0 <= args.max_restarts <= 1000:
            raise ConfigError(f"--max-restarts {args.max_restarts} must be in 0..1000")
        secret = _load_or_create_secret(args.secret_file)
        if args.resume_from is not None:
            read_bundle(checkpoint.normalize_stem(args.resume_from))  # a bad one fails now
    except (ConfigError, CheckpointError) as exc:
        print(f"flodl coord: error: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"flodl coord: warning: listening on {args.host}: traffic is authenticated (HMAC) but "
            "not encrypted; tunnel it (ssh -L) across untrusted networks",
            file=sys.stderr,
        )
    tracing = crash_trace.enable()  # a native crash prints the service's stacks (docs/design.md §8)
    try:
        import uvloop

        return int(uvloop.run(_serve(args, terms, secret)))
    except KeyboardInterrupt:
        return 130
    finally:
        crash_trace.disable(tracing)


async def _serve(args: argparse.Namespace, terms: JobTerms, secret: bytes) -> int:
    """Every segment of the run, on one control port."""
    port = args.port
    restarts = 0
    while True:
        sink = _CoordSink()
        service = CoordinatorService(
            terms,
            secret,
            host=args.host,
            port=port,
            data_port=args.data_port,
            sink=sink,
            on_defined=sink.defined,
            freeze_heap=True,  # this process is the coordinator's alone
        )
        sink.service = service
        port = await service.start()
        if restarts == 0:
            w, m = terms.world_size, terms.min_world_size
            sizes = str(w) if m in (None, w) else f"{m} to {w}"
            core = "compiled" if coord.compiled() else "interpreted"
            print(
                f"flodl coordinator for run {terms.run_id!r} ({sizes} ranks; the first rank "
                f"brings the job; {core} core) on {args.host}:{port}\n"
                f"ranks join with: FLODL_COORD={args.host}:{port} "
                f"FLODL_SECRET_FILE={args.secret_file} FLODL_RUN_ID={terms.run_id}",
                flush=True,
            )
        try:
            over = await service.wait()
        finally:
            await service.close()
        print(f"flodl coordinator: {over.reason}", flush=True)
        stopped = over.save_reason is not None and over.save_reason != "graceful_shutdown"
        job = service.job
        stem = job.save_stem if job is not None else None
        if stopped and restarts < args.max_restarts and job is not None:
            restarts += 1
            resume = stem if stem is not None and checkpoint.meta_path(stem).exists() else None
            terms = replace(terms, resume_from=resume)
            where = f"from the bundle {resume}" if resume else "from the start (no bundle yet)"
            print(
                f"flodl coordinator: restart {restarts} of {args.max_restarts} "
                f"({over.save_reason}): waiting on {args.host}:{port} for the ranks, to "
                f"resume {where}",
                flush=True,
            )
            continue
        if stopped:
            from flodl.handle import training_stopped

            assert over.save_reason is not None
            message = training_stopped(
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
            print(f"flodl coord: {message}", file=sys.stderr, flush=True)
        return 0 if over.ok else 1


class _CoordSink(LoggingSink):
    """Logged, plus the coordinator's part of bundles (once the job names the stem)."""

    def __init__(self) -> None:
        self.bundles = BundleWriter(None)
        self.service: CoordinatorService | None = None

    def defined(self, job: DefinedJob) -> None:
        self.bundles = BundleWriter(job.save_stem, self.service)
        print(f"flodl coordinator: {job.summary()}", flush=True)

    def write_meta(self, effect: WriteMeta) -> None:
        self.bundles.write_meta(effect)

    def bundle_requested(self, effect: BundleRequested) -> None:
        self.bundles.bundle_requested(effect)
