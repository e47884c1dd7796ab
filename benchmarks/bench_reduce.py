"""CPU averaging round (ReduceServer over loopback) next to a Gloo all_reduce of the same model.

Usage::

    python benchmarks/bench_reduce.py [--quick] [--reps N] [--json PATH]

For every model size (16/64/256 MiB of f32; ``--quick``: 16/64) and world size (2, 4), in one
run:

* ``cpu f32`` / ``cpu bf16``: one averaging round of :class:`flodl.service.reduce.ReduceServer`
  (in this process) with ``world`` rank processes, each a :class:`flodl.rank.reduce_client.
  ReduceClient` uploading its pre-scaled parameters (4 tensors) and 2 small buffers and
  receiving the consensus, over 127.0.0.1. Round time = the slowest rank's ``reduce()`` call,
  all ranks released by one barrier; best of ``--reps``.
* ``gloo``: ``world`` processes in one ``init_process_group("gloo")`` (TCPStore on 127.0.0.1)
  timing ``all_reduce`` + ``div_`` of one flat tensor of the same size (the best case for Gloo,
  as a DDP bucket), slowest rank, best of ``--reps``.
* ``memcpy``: ``dst.copy_(src)`` of the same bytes; ``mac``: the frame MAC
  (:func:`~flodl.wire.tensors.frame_tag`: key derivation, then Poly1305) of the same bytes on
  one core; ``fold``: the server's sum and division for that world (``torch.add`` + ``div_``).

At world 2 every case also runs as ``tag-first``: the ablation where client and server tag a
frame before sending its first byte (what :func:`~flodl.wire.tensors.encode_tensor_frame`
then ``send_buffers`` does), against the default that sends the payloads while another thread
computes the tag that ends the frame.

``loop lag``: one world-2 round of ``--lag-mib`` MiB (default 256) with both ranks as threads of
this process, while a task on uvloop in this thread (the coordinator's event loop) sleeps 1 ms
at a time; the lag is how late each wake-up is. Reported: p50 / p99 / max over every tick of
``--reps`` rounds (target: p99 < 50 ms: the reduce server's threads never hold the GIL long
enough to starve the control loop's heartbeats).

Ratios are CPU round / Gloo (targets at world 2, 64 MiB: f32 <= 1.2, bf16 <= 0.8). ``wire GB/s``
is bytes on the wire per round (uplink and downlink, every rank) per second, next to memcpy.
The MAC breakdown: every byte is authenticated ``3W + 1`` times per round (each rank's upload
by the rank and the server, the consensus once by the server and once by each rank), all on
CPUs shared by the ranks, the server and Gloo alike; ``mac floor`` = that work at the measured
single-core MAC rate divided by the cores available, the least time any round of this format
can take on this machine. ``cpu ms`` is the CPU time (user + system) of the server and every
rank process during the best round, ``cores busy`` that over the round's wall time, ``mac/cpu``
the share of it the MAC passes alone account for, ``sys/cpu`` the kernel's share (loopback
TCP copies every byte twice).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import (
    RESULTS_DIR,
    add_markdown_option,
    best_of,
    ensure_repo_on_path,
    machine_info,
    print_table,
    run_line,
    uptime,
    write_json,
)

ensure_repo_on_path()

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

import flodl.service.reduce as reduce_server  # noqa: E402
from flodl.rank import reduce_client  # noqa: E402
from flodl.rank.reduce_client import ReduceClient  # noqa: E402
from flodl.service.reduce import ReduceServer  # noqa: E402
from flodl.wire.tensors import INLINE_TAG_BYTES, frame_tag  # noqa: E402

STREAM_TAGS = (INLINE_TAG_BYTES, INLINE_TAG_BYTES)


def _set_inline_tag_bytes(module: ModuleType, value: int) -> None:
    """The ablation: patch the threshold the server's or the client's module reads per frame."""
    module.__dict__["INLINE_TAG_BYTES"] = value


NEVER = 1 << 62  # an inline-tag threshold no frame reaches: tag first, then send

SECRET = b"bench-reduce-secret-0123456789ab"
RUN_ID = "bench-reduce"
PARAM_TENSORS = 4
BUFFER_NUMEL = 256
TARGETS = {"shm": (1.0, 0.6), "tcp": (1.2, 0.8)}
"""Round / Gloo targets (f32, bf16) at 64 MiB, worlds 2 and 4: the shared-memory lane's (the
local ranks') and loopback TCP's (what remote ranks get)."""
TARGET_LAG_P99_MS = 50.0
MIB = 1 << 20


def _threads(world: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world)


def _cpu_times() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _model(mib: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    numel = mib * MIB // 4 // PARAM_TENSORS
    gen = torch.Generator().manual_seed(rank)
    params = [torch.randn(numel, generator=gen) for _ in range(PARAM_TENSORS)]
    buffers = [torch.randn(BUFFER_NUMEL, generator=gen) for _ in range(2)]
    return params, buffers


# ---------------------------------------------------------------------- rank processes
def _cpu_rank(rank: int, world: int, jobs: Any, results: Any, barrier: Any) -> None:
    """Run every phase the parent sends: (port, mib, bf16, reps, stream, shm) or None to
    stop."""
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    torch.set_num_threads(_threads(world))
    while (job := jobs.get()) is not None:
        port, mib, bf16, reps, stream, shm = job
        _set_inline_tag_bytes(reduce_client, STREAM_TAGS[1] if stream else NEVER)
        params, buffers = _model(mib, rank)
        client = ReduceClient(
            "127.0.0.1",
            port,
            SECRET,
            rank,
            world,
            run_id=RUN_ID,
            bf16_wire=bf16,
            shared_memory=shm,
        )
        client.connect(30.0)
        try:
            client.reduce(0, params, 1.0 if rank == 0 else 0.0, buffers, rank == 0)  # warm-up
            if client.in_shared_memory != shm:
                raise RuntimeError(f"rank {rank}: shared memory {client.in_shared_memory}")
            for cycle in range(1, reps + 1):
                barrier.wait()
                cpu = _cpu_times()
                start = time.perf_counter()
                client.reduce(cycle, params, float(rank + 1), buffers, True)
                elapsed = time.perf_counter() - start
                user, system = (b - a for a, b in zip(cpu, _cpu_times(), strict=True))
                results.put((rank, cycle, elapsed, user, system))
        finally:
            client.close()
        del params, buffers


def _gloo_rank(rank: int, world: int, port: int, sizes: list[int], reps: int, results: Any) -> None:
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch.distributed as dist

    torch.set_num_threads(_threads(world))
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        for mib in sizes:
            flat = torch.randn(mib * MIB // 4)
            for rep in range(reps + 1):  # rep 0 warms up
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(flat)
                flat.div_(world)
                results.put((mib, rank, rep, time.perf_counter() - start))
            del flat
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- measurements
LANES = ("shm", "tcp", "tcp tag-first")
"""How the ranks reach the server: the shared-memory lane (ranks on the server's host, the
default there), loopback TCP (what a remote rank uses), and TCP with the ablation where every
frame is tagged before its first byte is sent (client and server)."""


def measure_cpu(
    world: int, cases: list[tuple[int, bool, str]], reps: int
) -> dict[tuple[int, bool, str], tuple[float, float, float]]:
    """Per case ``(mib, bf16, lane)`` (:data:`LANES`), the best round: (wall, user CPU, system
    CPU) seconds, CPU summed over the server and every rank process."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    barrier = ctx.Barrier(world + 1)
    jobs = [ctx.Queue() for _ in range(world)]
    procs = [
        ctx.Process(target=_cpu_rank, args=(r, world, jobs[r], results, barrier), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    best: dict[tuple[int, bool, str], tuple[float, float, float]] = {}
    try:
        for mib, bf16, lane in cases:
            stream, shm = lane != "tcp tag-first", lane == "shm"
            _set_inline_tag_bytes(reduce_server, STREAM_TAGS[0] if stream else NEVER)
            done: queue.SimpleQueue[int] = queue.SimpleQueue()
            server = ReduceServer(
                SECRET,
                run_id=RUN_ID,
                world_size=world,
                on_done=functools.partial(_report_done, done),
                max_frame_bytes=max(2 * mib * MIB + MIB, 64 * MIB),
            )
            port = server.start()
            try:
                server.open_round(0, range(world))
                for q in jobs:
                    q.put((port, mib, bf16, reps, stream, shm))
                done.get(timeout=600)
                rounds = []
                for cycle in range(1, reps + 1):
                    server.open_round(cycle, range(world))
                    cpu = _cpu_times()
                    barrier.wait(timeout=600)
                    per_rank = [results.get(timeout=600) for _ in range(world)]
                    user, system = (b - a for a, b in zip(cpu, _cpu_times(), strict=True))
                    assert all(r[1] == cycle for r in per_rank)
                    rounds.append(
                        (
                            max(r[2] for r in per_rank),
                            user + sum(r[3] for r in per_rank),
                            system + sum(r[4] for r in per_rank),
                        )
                    )
                best[(mib, bf16, lane)] = min(rounds)
            finally:
                server.close()
                _set_inline_tag_bytes(reduce_server, STREAM_TAGS[0])
            print(
                f"  world {world} {mib:4d} MiB {'bf16' if bf16 else 'f32 '} {lane}: "
                f"{best[(mib, bf16, lane)][0] * 1e3:8.1f} ms",
                flush=True,
            )
    finally:
        for q in jobs:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
    return best


def measure_gloo(world: int, sizes: list[int], reps: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, world, port, sizes, reps, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rep: dict[tuple[int, int], float] = {}
    for _ in range(world * len(sizes) * (reps + 1)):
        mib, _rank, rep, seconds = results.get(timeout=600)
        per_rep[(mib, rep)] = max(per_rep.get((mib, rep), 0.0), seconds)
    for p in procs:
        p.join(timeout=60)
    best = {mib: min(per_rep[(mib, rep)] for rep in range(1, reps + 1)) for mib in sizes}
    for mib in sizes:
        print(f"  world {world} {mib:4d} MiB gloo: {best[mib] * 1e3:8.1f} ms", flush=True)
    return best


def _report_done(done: queue.SimpleQueue[int], cycle: int, *_: object) -> None:
    done.put(cycle)


def _fold(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """The server's fold of ``len(parts)`` uploads: sum in rank order, divide once."""
    torch.add(parts[0], parts[1], out=dst)
    for p in parts[2:]:
        dst.add_(p)
    dst.div_(float(len(parts)))


def measure_local(sizes: list[int], worlds: list[int], reps: int) -> dict[str, Any]:
    memcpy: dict[int, float] = {}
    fold: dict[tuple[int, int], float] = {}
    for mib in sizes:
        src = torch.randn(mib * MIB // 4)
        dst = torch.empty_like(src)
        memcpy[mib] = mib * MIB / best_of(functools.partial(dst.copy_, src), reps)
        for world in worlds:
            fold[(mib, world)] = best_of(functools.partial(_fold, dst, [src] * world), reps)
    data = os.urandom(64 * MIB)
    mac_rate = len(data) / best_of(lambda: frame_tag(SECRET, b"", [data]), reps)
    return {"memcpy": memcpy, "fold": fold, "mac": mac_rate}


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def measure_loop_lag(mib: int, reps: int) -> dict[str, Any]:
    """Event-loop lag in this thread while ``reps`` world-2 rounds of ``mib`` MiB run, both
    ranks as threads of this process (:class:`ReduceClient`), the server in this process."""
    import uvloop

    numel = mib * MIB // 4 // PARAM_TENSORS
    params = [[torch.full((numel,), float(r + 1)) for _ in range(PARAM_TENSORS)] for r in range(2)]
    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    server = ReduceServer(
        SECRET,
        world_size=2,
        run_id=RUN_ID,
        on_done=functools.partial(_report_done, done),
        max_frame_bytes=2 * mib * MIB + MIB,
    )
    port = server.start()
    clients = [  # TCP, what remote ranks load the server with (the lane is far lighter)
        ReduceClient("127.0.0.1", port, SECRET, r, 2, run_id=RUN_ID, shared_memory=False)
        for r in range(2)
    ]
    lags: list[float] = []
    rounds_ms: list[float] = []
    try:
        for client in clients:
            client.connect(30.0)

        async def one_round(cycle: int) -> None:
            errors: list[BaseException] = []

            def rank(r: int) -> None:
                try:
                    clients[r].reduce(cycle, params[r], float(r + 1), [], True)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            server.open_round(cycle, [0, 1])
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                due = time.perf_counter() + 0.001  # uvloop's loop.time() has 1 ms resolution
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - due)
            rounds_ms.append((time.perf_counter() - start) * 1e3)
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            done.get(timeout=60)

        async def rounds() -> None:
            for cycle in range(1, reps + 1):
                await one_round(cycle)

        uvloop.run(rounds())
    finally:
        for client in clients:
            client.close()
        server.close()
    lags.sort()
    result = {
        "mib": mib,
        "rounds": reps,
        "ticks": len(lags),
        "round_ms_median": sorted(rounds_ms)[len(rounds_ms) // 2],
        "lag_p50_ms": _percentile(lags, 0.50) * 1e3,
        "lag_p99_ms": _percentile(lags, 0.99) * 1e3,
        "lag_max_ms": lags[-1] * 1e3,
        "target_p99_ms": TARGET_LAG_P99_MS,
    }
    result["target_met"] = result["lag_p99_ms"] < TARGET_LAG_P99_MS
    return result


def wire_bytes(mib: int, world: int, bf16: bool) -> int:
    """Payload bytes on the wire in one round: every rank's upload and its consensus."""
    itemsize = 2 if bf16 else 4
    model = mib * MIB // 4 * itemsize + 2 * BUFFER_NUMEL * itemsize
    return 2 * world * model


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    lag = data["loop_lag"]
    lines = [
        f"## CPU averaging round vs Gloo (`{data['command']}`)",
        "",
        (
            f"{run_line(data, 'best of ' + str(data['reps']))} "
            f"Machine: {data['machine'].get('cpus', '?')} CPUs, torch {data['torch']}, "
            f"Python {data['python']}."
        ),
        "",
        (
            "One CPU averaging round of the `ReduceServer` (each rank process uploads its weighted "
            "parameters, the server folds them and returns the consensus) against Gloo "
            "`all_reduce` + divide of the same bytes at the same world size, in the same run. "
            "Lanes: `shm` is what ranks on the server's host use (the shared-memory lane, "
            "docs/design.md §1: payloads through memory, only headers on the socket and "
            "authenticated); `tcp` is "
            "what remote ranks use (authenticated frames over loopback TCP); `tcp tag-first` is "
            "the ablation that tags a frame before sending it. `MAC floor` is the frame "
            "authentication work of the round at the measured one-core Poly1305 rate "
            f"({data['mac_gbps_1core']:.1f} GB/s) over the cores; `cores busy` is the CPU time of "
            "the server and every rank over the round's wall time."
        ),
        "",
        (
            "| case | round ms | Gloo ms | round / Gloo | target | MAC floor ms | fold ms "
            "| cores busy | sys share |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        target = (
            "–"
            if r["target_ratio"] is None
            else f"≤ {r['target_ratio']}×: **{'met' if r['target_met'] else 'not met'}**"
        )
        lines.append(
            f"| world {r['world']}, {r['mib']} MiB {r['wire']}, {r['lane']} "
            f"| {r['round_ms']:.1f} | {r['gloo_ms']:.1f} | {r['ratio_vs_gloo']:.2f}× | {target} "
            f"| {r['mac_floor_ms']:.1f} | {r['fold_ms']:.1f} | {r['cores_busy']:.2f} "
            f"| {100 * r['cpu_system_ms'] / max(r['cpu_ms'], 1e-9):.0f} % |"
        )
    lines += [
        "",
        (
            f"Event-loop lag on the server's loop during world-2 rounds of {lag['mib']} MiB (ranks "
            f"as threads over TCP, 1 ms ticks): {lag['ticks']} ticks over {lag['rounds']} "
            f"rounds, p50 "
            f"{lag['lag_p50_ms']:.2f} ms, p99 {lag['lag_p99_ms']:.2f} ms (target < "
            f"{TARGET_LAG_P99_MS:g} ms: **{'met' if lag['target_met'] else 'not met'}**), max "
            f"{lag['lag_max_ms']:.1f} ms."
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 and 64 MiB only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (best of)")
    parser.add_argument(
        "--lag-mib", type=int, default=256, help="model size of the loop-lag rounds (MiB)"
    )
    parser.add_argument(
        "--lag-only", action="store_true", help="only the event-loop lag measurement"
    )
    parser.add_argument("--json", default=str(RESULTS_DIR / "bench_reduce.json"))
    add_markdown_option(parser, RESULTS_DIR / "bench_reduce.json")
    args = parser.parse_args()
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    sizes = [16, 64] if args.quick else [16, 64, 256]
    worlds = [2, 4]
    reps = args.reps or (3 if args.quick else 5)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    uptime_before = uptime()
    print(f"{date}; {uptime_before}")
    print(f"bench_reduce: sizes {sizes} MiB, worlds {worlds}, best of {reps}, {cores} cores")
    lag = measure_loop_lag(args.lag_mib, reps)
    print(
        f"event-loop lag during a world-2 {lag['mib']} MiB round (ranks as threads over TCP,"
        f" 1 ms ticks,"
        f" {lag['ticks']} ticks over {lag['rounds']} rounds of ~{lag['round_ms_median']:.0f} ms):"
        f" p50 {lag['lag_p50_ms']:.2f} ms, p99 {lag['lag_p99_ms']:.2f} ms"
        f" (target < {TARGET_LAG_P99_MS:g} ms: {'met' if lag['target_met'] else 'NOT met'}),"
        f" max {lag['lag_max_ms']:.1f} ms",
        flush=True,
    )
    if args.lag_only:
        return
    local = measure_local(sizes, worlds, reps)
    rows: list[list[object]] = []
    records: list[dict[str, Any]] = []
    for world in worlds:
        gloo = measure_gloo(world, sizes, reps)
        lanes = LANES if world == 2 else LANES[:2]
        cases = [(mib, bf16, lane) for mib in sizes for bf16 in (False, True) for lane in lanes]
        cpu = measure_cpu(world, cases, reps)
        for mib, bf16, lane in sorted(cases, key=lambda c: (c[0], c[1], LANES.index(c[2]))):
            seconds, user, system = cpu[(mib, bf16, lane)]
            nbytes = wire_bytes(mib, world, bf16)
            # the shared-memory lane authenticates headers only: no payload byte is MAC'd
            macs = 0 if lane == "shm" else 3 * world + 1
            mac_cpu = macs * nbytes / (2 * world) / local["mac"]
            mac_floor = mac_cpu / (cores or 1)
            ratio = seconds / gloo[mib]
            pair = TARGETS.get(lane)
            target = None if pair is None or mib != 64 else pair[1] if bf16 else pair[0]
            wire = "bf16" if bf16 else "f32"
            record = {
                "world": world,
                "mib": mib,
                "wire": wire,
                "lane": lane,
                "round_ms": seconds * 1e3,
                "gloo_ms": gloo[mib] * 1e3,
                "ratio_vs_gloo": ratio,
                "target_ratio": target,
                "target_met": None if target is None else ratio <= target,
                "wire_bytes": nbytes,
                "wire_gbps": nbytes / seconds / 1e9,
                "memcpy_gbps": local["memcpy"][mib] / 1e9,
                "mac_gbps_1core": local["mac"] / 1e9,
                "mac_floor_ms": mac_floor * 1e3,
                "cpu_ms": (user + system) * 1e3,
                "cpu_user_ms": user * 1e3,
                "cpu_system_ms": system * 1e3,
                "cores_busy": (user + system) / seconds,
                "mac_share_of_cpu": mac_cpu / (user + system),
                "fold_ms": local["fold"][(mib, world)] * 1e3,
            }
            records.append(record)
            rows.append(
                [
                    f"w{world} {mib} MiB {wire} {lane}",
                    record["round_ms"],
                    record["gloo_ms"],
                    ratio,
                    record["wire_gbps"],
                    record["memcpy_gbps"],
                    record["mac_floor_ms"],
                    record["fold_ms"],
                    record["cpu_ms"],
                    record["cores_busy"],
                    f"{100 * record['mac_share_of_cpu']:.0f}%",
                    f"{100 * system / (user + system):.0f}%",
                ]
            )
    print_table(
        f"CPU averaging round vs Gloo all_reduce (best of {reps}; {cores} cores; "
        f"mac {local['mac'] / 1e9:.2f} GB/s on one core)",
        [
            "case",
            "round ms",
            "gloo ms",
            "round/gloo",
            "wire GB/s",
            "memcpy GB/s",
            "mac floor ms",
            "fold ms",
            "cpu ms",
            "cores busy",
            "mac/cpu",
            "sys/cpu",
        ],
        rows,
    )
    print()
    for r in records:
        if r["target_ratio"] is not None:
            verdict = "met" if r["target_met"] else "NOT met"
            print(
                f"target world {r['world']}, {r['mib']} MiB {r['wire']} {r['lane']}: "
                f"{r['ratio_vs_gloo']:.2f} (<= {r['target_ratio']}): {verdict}"
            )
    path = write_json(
        args.json,
        {
            "benchmark": "bench_reduce",
            "command": " ".join(["python benchmarks/bench_reduce.py", *sys.argv[1:]]),
            "date": date,
            "uptime_before": uptime_before,
            "uptime_after": uptime(),
            "quick": args.quick,
            "reps": reps,
            "machine": machine_info(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "mac_gbps_1core": local["mac"] / 1e9,
            "loop_lag": lag,
            "rows": records,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
