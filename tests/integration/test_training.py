"""Real training: the coordinator service in this process, ranks as real processes on 127.0.0.1.

Every test spawns rank processes (``rank_main.py``), kills whatever is left in ``finally`` and
checks that nothing outlives it. Timeouts are scaled down (10 s liveness instead of 30 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.coord.effects import (
    Alert,
    BundleRequested,
    EpochDone,
    EvalDone,
    Record,
    RunOver,
    WriteMeta,
)
from flodl.service.coordinator import CoordinatorService
from flodl.timeouts import Timeouts
from flodl.wire.frames import EpochMetrics

pytestmark = [pytest.mark.integration, pytest.mark.uvloop]

HERE = Path(__file__).resolve().parent
RANK_MAIN = HERE / "rank_main.py"
COORD_MAIN = HERE / "coord_main.py"
MODES = ["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]


@dataclass
class Sink:
    epochs: list[EpochMetrics] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    metas: list[WriteMeta] = field(default_factory=list)

    def write_meta(self, effect: WriteMeta) -> None:
        self.metas.append(effect)

    def bundle_requested(self, effect: BundleRequested) -> None:
        return None

    def record(self, effect: Record) -> None:
        return None

    def alert(self, effect: Alert) -> None:
        self.alerts.append(effect)

    def epoch_done(self, effect: EpochDone) -> None:
        self.epochs.append(effect.metrics)

    def eval_done(self, effect: EvalDone) -> None:
        return None


@dataclass
class Run:
    mode: str
    world: int
    tmp: Path
    dataset_len: int = 2048
    batch_size: int = 32
    epochs: int = 3
    slow_ms: dict[int, float] = field(default_factory=dict)
    sink: Sink = field(default_factory=Sink)
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    service: CoordinatorService | None = None
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    async def start(self) -> None:
        cfg = validated(
            CoordConfig,
            world_size=self.world,
            dataset_len=self.dataset_len,
            batch_size=self.batch_size,
            num_epochs=self.epochs,
            elche=ElCheConfig.preset(self.mode),
            timeouts=Timeouts(10.0, scale=0.2),  # stall floor 60 s
        )
        self.service = CoordinatorService(cfg, self.secret, sink=self.sink)
        port = await self.service.start()
        for rank in range(self.world):
            self.procs.append(await spawn_rank(self, rank, port))

    async def finish(self, limit_s: float = 90.0) -> tuple[RunOver, list[int]]:
        assert self.service is not None
        over = await asyncio.wait_for(self.service.wait(), limit_s)
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs)), 30)
        return over, list(codes)

    def state(self, rank: int) -> dict[str, Any]:
        loaded: dict[str, Any] = torch.load(self.tmp / f"rank{rank}.pt", weights_only=True)
        return loaded

    async def cleanup(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.kill()
        for p in self.procs:
            await p.wait()
        if self.service is not None:
            await self.service.close()


async def spawn_rank(run: Run, rank: int, port: int) -> asyncio.subprocess.Process:
    job = {
        "port": port,
        "rank": rank,
        "world_size": run.world,
        "mode": run.mode,
        "dataset_len": run.dataset_len,
        "batch_size": run.batch_size,
        "stem": str(run.tmp / "run"),
        "out": str(run.tmp / f"rank{rank}.pt"),
        "slow_ms": run.slow_ms.get(rank, 0.0),
        "heartbeat_timeout_s": 10.0,
    }
    env = {**os.environ, "FLODL_TEST_RANK": json.dumps(job), "FLODL_SECRET": run.secret.hex()}
    return await asyncio.create_subprocess_exec(sys.executable, str(RANK_MAIN), env=env)


def params_of(state: dict[str, Any]) -> list[torch.Tensor]:
    return list(state["params"])


def assert_exact_coverage(run: Run) -> None:
    assert run.service is not None
    log = run.service.machine.dispatch.coverage_log
    assert sorted(log) == list(range(run.epochs))
    for epoch, report in log.items():
        assert report.ok, (epoch, report)
        assert report.committed == report.total


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", MODES)
async def test_every_mode_trains_a_real_model(mode: str, world: int, tmp_path: Path) -> None:
    run = Run(mode, world, tmp_path)
    try:
        await run.start()
        over, codes = await run.finish()
        assert over.ok, over.reason
        assert codes == [0] * world
        assert len(run.sink.epochs) == run.epochs
        first, last = run.sink.epochs[0].avg_loss, run.sink.epochs[-1].avg_loss
        assert last < 0.6 * first, (first, last)
        assert_exact_coverage(run)
        states = [params_of(run.state(r)) for r in range(world)]
        # every rank ends on the consensus of the final reduce (EASGD ranks return the
        # consensus they retained, not their elastic blend)
        for other in states[1:]:
            for a, b in zip(states[0], other, strict=True):
                assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())
    finally:
        await run.cleanup()


async def wait_until(pred: Any, limit_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not pred():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", MODES)
async def test_sigkill_one_of_three_ranks_mid_epoch(mode: str, tmp_path: Path) -> None:
    run = Run(mode, 3, tmp_path, dataset_len=4096, slow_ms={0: 1.0, 1: 1.0, 2: 1.0})
    try:
        await run.start()
        assert run.service is not None
        machine = run.service.machine
        await wait_until(lambda: machine.sync_rounds >= 3, 60, "three averaging cycles")
        victim = run.procs[1]
        victim.send_signal(signal.SIGKILL)
        over, codes = await run.finish()
        assert over.ok, over.reason
        assert codes[1] == -signal.SIGKILL
        assert codes[0] == 0
        assert codes[2] == 0
        assert machine.membership.liveness.dead() == [1]
        assert_exact_coverage(run)
        assert [a.cls for a in run.sink.alerts].count("rank_lost") == 1
        a, b = params_of(run.state(0)), params_of(run.state(2))
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))
    finally:
        await run.cleanup()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
async def test_sigkill_coordinator_ranks_exit_with_death_records(mode: str, tmp_path: Path) -> None:
    """The coordinator dies while both ranks train: each exits on its own, non-zero, with a
    death record that blames the coordinator. The kill waits for the coordinator's ``TRAINING``
    line (every rank joined, an averaging cycle done), not for a guessed delay."""
    secret = secrets.token_bytes(32)
    job = {"world_size": 2, "dataset_len": 100_000, "batch_size": 32, "epochs": 50, "mode": mode}
    env = {**os.environ, "FLODL_TEST_COORD": json.dumps(job), "FLODL_SECRET": secret.hex()}
    coord = await asyncio.create_subprocess_exec(
        sys.executable, str(COORD_MAIN), env=env, stdout=asyncio.subprocess.PIPE
    )
    run = Run(mode, 2, tmp_path, dataset_len=100_000, epochs=50, secret=secret)
    try:
        assert coord.stdout is not None
        port = int((await asyncio.wait_for(coord.stdout.readline(), 60)).decode())
        run.procs = [await spawn_rank(run, r, port) for r in range(2)]
        # once both ranks train, kill the coordinator outright
        line = await asyncio.wait_for(coord.stdout.readline(), 120)
        assert line == b"TRAINING\n", line
        assert all(p.returncode is None for p in run.procs)
        coord.send_signal(signal.SIGKILL)
        await coord.wait()
        # the ranks notice on their own (EOF, or the 10 s liveness timeout, then the hard exit)
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in run.procs)), 60)
        assert all(c != 0 for c in codes), codes
        for r in range(2):
            record = json.loads((tmp_path / f"run.rank{r}.death.json").read_text())
            assert record["rank"] == r
            assert record["world_size"] == 2
            assert record["schema_version"] == 1
            assert "coordinator" in record["error"].lower() or "lost" in record["error"].lower()
    finally:
        if coord.returncode is None:
            coord.kill()
            await coord.wait()
        await run.cleanup()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
async def test_slow_rank_gets_a_proportional_share(mode: str, tmp_path: Path) -> None:
    """The slow rank's share of the batches follows its measured speed: it is the smallest,
    and it matches the rank's throughput over the sum (the coordinator's own figures, whatever
    the machine adds to the injected sleeps; the split between the two equal fast ranks drifts
    with the last windows' timings). How busy the fast ranks stay is a figure:
    ``python benchmarks/bench_hetero.py`` (coord busy)."""
    # compute per step: 2 ms on the fast ranks, 6 ms on the slow one (an injected sleep)
    run = Run(mode, 3, tmp_path, dataset_len=16_384, epochs=2, slow_ms={0: 2.0, 1: 2.0, 2: 6.0})
    try:
        await run.start()
        over, codes = await run.finish(limit_s=150)
        assert over.ok, over.reason
        assert codes == [0, 0, 0]
        last = run.sink.epochs[-1]
        share, speed = last.per_rank_batch_share, last.per_rank_throughput
        assert share[2] < min(share[0], share[1]), share
        assert all(s > 0 for s in last.per_rank_samples), last.per_rank_samples
        proportional = speed[2] / sum(speed)  # ≈ 1 / (3 + 3 + 1) if the sleeps dominate
        assert abs(share[2] - proportional) <= 0.05, (share, speed)
    finally:
        await run.cleanup()
