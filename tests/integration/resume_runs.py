"""Shared helpers of the resume tests: run ``callbacks_main.py`` (the user's script) in a
subprocess and read back what each rank trained.

Ranks log the sample ids of every batch they train to ``<log dir>/rank<N>.ids``, so a test can
check per-epoch coverage against a bundle's meta.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from processes import left_running

from flodl import checkpoint
from flodl.chaos import ChaosPlan
from flodl.monitor.records import read_tree

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "callbacks_main.py"
REPO = HERE.parents[1]
BS = 32


def run(
    tmp: Path,
    name: str,
    *args: str,
    limit_s: float = 150,
    tag: str | None = None,
    timeout_scale: float = 0.2,
) -> subprocess.CompletedProcess[str]:
    """``callbacks_main.py`` with ``args``, logging to ``tmp/name``, its network deadlines
    scaled by ``timeout_scale``; its output is kept in ``tmp/name.stdout`` and
    ``tmp/name.stderr``."""
    out = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--tag", tag or f"flodl-test-{uuid.uuid4().hex}"),
            *("--log-dir", str(tmp / name), *args),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=limit_s,
        cwd=REPO,
        env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": str(timeout_scale)},
    )
    (tmp / f"{name}.stdout").write_text(out.stdout)
    (tmp / f"{name}.stderr").write_text(out.stderr)
    return out


def completed_chaos_run(
    tmp: Path,
    mode: str,
    plan: ChaosPlan,
    *args: str,
    epochs: int,
    samples: int,
    timeout_scale: float = 0.2,
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[dict[str, Any]]]]:
    """A 3-rank ``callbacks_main.py`` run of ``mode`` with ``args`` and the chaos ``plan``,
    logging to ``tmp/a``, that must complete with identical replicas and leave no process
    behind; its output and its record tree."""
    tag = f"flodl-test-{uuid.uuid4().hex}"
    records = tmp / "records"
    out = run(
        tmp,
        "a",
        *("--mode", mode, "--epochs", str(epochs), "--samples", str(samples), "--ranks", "3"),
        *args,
        *("--chaos", plan.to_env(), "--records", str(records)),
        tag=tag,
        timeout_scale=timeout_scale,
        limit_s=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert done(out.stdout) == {"save_reason": None, "replicas_agree": True}
    assert left_running(tag, 15) == [], "a process of the run outlived it"
    return out, read_tree(records)


def forget_run(tmp: Path, name: str, stem: Path) -> None:
    """Remove a run's logs and its bundle's files (an attempt that is tried again)."""
    shutil.rmtree(tmp / name)
    for leftover in stem.parent.glob(stem.name + ".*"):
        leftover.unlink()


def metrics(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line[8:]) for line in stdout.splitlines() if line.startswith("METRICS ")]


def done(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("DONE ")]
    assert len(lines) == 1, stdout[-2000:]
    result: dict[str, Any] = json.loads(lines[0][5:])
    return result


def evals(stdout: str) -> list[tuple[int, float]]:
    """The ``EVAL <epoch> <accuracy>`` lines of a run with ``--eval``."""
    return [
        (int(e), float(v))
        for e, v in (line.split()[1:3] for line in stdout.splitlines() if line.startswith("EVAL "))
    ]


PARITY_MODES = ("cpu_cadence", "nccl_cadence")
"""The modes whose held-out accuracy the resize and rejoin tests compare with uninterrupted
runs (one per averaging backend; each costs an extra run per world size, and CI's time is
bounded). Coverage is checked in every mode."""


def within_parity(acc: float, baseline: float) -> bool:
    """The parity bound of docs/benchmarks.md: within 0.5 pp or 2 % relative of the baseline."""
    return acc >= baseline - max(0.005, 0.02 * baseline)


def uninterrupted(tmp: Path, common: Sequence[str], world: int) -> float:
    """The final held-out accuracy (``--eval``) of the same run at ``world`` ranks, never
    interrupted."""
    u = run(tmp, f"u{world}", *common, "--ranks", str(world))
    assert u.returncode == 0, u.stderr[-3000:]
    return evals(u.stdout)[-1][1]


def rank_batches(log_dir: Path, rank: int) -> list[list[int]]:
    path = log_dir / f"rank{rank}.ids"
    if not path.exists():
        return []
    return [[int(i) for i in line.split(",")] for line in path.read_text().splitlines() if line]


def split_epochs(log_dir: Path, ms: Sequence[dict[str, Any]], world: int) -> dict[int, list[int]]:
    """Sample ids trained per epoch (each rank's batches are in order; cadence never hands a
    rank a step across an epoch barrier, so its log splits by its per-epoch sample counts)."""
    out: dict[int, list[int]] = {m["epoch"]: [] for m in ms}
    for r in range(world):
        batches = rank_batches(log_dir, r)
        pos = 0
        for m in ms:
            n = m["per_rank_samples"][r] // BS
            for b in batches[pos : pos + n]:
                out[m["epoch"]].extend(b)
            pos += n
    return out


def final_matches_bundle(out_file: Path, stem: Path) -> bool:
    saved = checkpoint.load_model(stem)
    state = torch.load(out_file, weights_only=True)
    return all(torch.equal(a, b) for a, b in zip(saved.params, state["params"], strict=True))
