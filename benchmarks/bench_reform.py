"""bench_reform: what re-forming a collective session costs the coordinator at 64 … 4,096 ranks.

In the collective modes a death re-forms the group among the survivors: the coordinator sends
every live rank ``declare_dead`` and every member the ``new_session`` that names the members
(docs/design.md §2, "Collective sessions"). This drives the real pure coordinator with
:class:`flodl.sim.SimCluster` (nccl_cadence, equal speeds), kills rank ``W / 2`` after the
first cycles, and times, on the input that reports the death:

* ``machine ms``: the coordinator's ``handle`` (the death, the re-form, the frames built);
* ``encode ms``: turning its ``send`` effects into wire bytes the way ``flodl coord``'s server
  does (``flodl.service.server``): each frame's body encoded once
  (:class:`flodl.wire.codec.SharedBodies`: one ``new_session`` serves every member since
  protocol 10), then sealed for each connection with its own key and frame counter;
* ``one body per send ms``: the same sends with every body encoded on its own, as the server
  did before protocol 10, when each member's ``new_session`` carried its own ``new_rank``;
* the bytes that go out: every member's frame carries the whole member list, so they grow
  with the square of the world size while the encoding, shared, grows with the world size.

Every connection's key is in the MAC's key cache before the timing, as on a live connection.
Each size runs ``--repeat`` times, interleaved; a row is the run with the median ``encode ms``.

    python benchmarks/bench_reform.py [--sizes 64,512,4096] [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    CoordinatorView,
    RunStamp,
    add_markdown_option,
    ensure_repo_on_path,
    markdown_table,
    print_table,
    section_head,
    write_json,
)

ensure_repo_on_path()

from flodl.coord.effects import Send  # noqa: E402
from flodl.coord.outbound import built_new_session  # noqa: E402
from flodl.sim import SimCluster  # noqa: E402
from flodl.sim.trace import Failure  # noqa: E402
from flodl.wire.codec import AnyFrame, SharedBodies, encode_frame, seal_body  # noqa: E402
from flodl.wire.frames import NewSession  # noqa: E402

SIZES = (64, 512, 4096)
REPEATS = 3
MODE = "nccl_cadence"
KILL_AT_S = 0.25
"""Virtual time of the kill: after the first cycles (10 ms steps, anchor 10)."""
SEQ = 1_000
"""The frame counter every connection seals at (its value does not change the cost)."""


class _Reformed(Exception):
    """Raised out of the simulator once the re-form is captured: the rest of the run is not
    this benchmark's."""


def capture(world: int) -> tuple[float, list[Send], str]:
    """Run ``world`` simulated ranks until a death re-forms the session; the ``handle`` call's
    seconds, its sends and the input's type."""
    sim = SimCluster(
        world,
        MODE,
        [10.0] * world,
        dataset_len=world * 10 * 4,
        batch_size=1,
        epochs=1,
        seed=1,
        check_invariants=False,
        failures=[Failure(world // 2, KILL_AT_S, "kill")],
    )
    coord = sim.coord
    handle = coord.handle
    got: list[tuple[float, list[Send], str]] = []

    def timed(event: Any, now: float) -> Any:
        t0 = time.perf_counter()
        out = handle(event, now)
        spent = time.perf_counter() - t0
        sends = [e for e in out if isinstance(e, Send)]
        if any(isinstance(s.frame, NewSession) for s in sends):
            got.append((spent, sends, type(event).__name__))
            raise _Reformed
        return out

    sim.coord = CoordinatorView(coord, handle=timed)  # type: ignore[assignment]
    try:
        sim.run()
    except _Reformed:
        return got[0]
    raise SystemExit(f"bench_reform: no re-form at {world} ranks (the kill did not land)")


def _key(rank: int) -> bytes:
    """A 32-byte connection key of its own for ``rank``."""
    return rank.to_bytes(4, "big") * 8


def seal_all(sends: Sequence[tuple[int, AnyFrame]]) -> tuple[list[bytes], float]:
    """Each ``(rank, frame)`` turned into wire bytes as the server does (a frame's body
    encoded once, sealed per connection with its key and counter); the bytes and the seconds
    it took. Every connection's key is in the MAC's cache first, as on a live connection."""
    keys = {rank: _key(rank) for rank, _ in sends}
    for key in keys.values():
        seal_body(b"warm", key, kind="warm")
    t0 = time.perf_counter()
    bodies = SharedBodies()
    wire = [seal_body(bodies.body(f), keys[r], kind=f.kind, seq=SEQ) for r, f in sends]
    return wire, time.perf_counter() - t0


def measure(world: int) -> dict[str, Any]:
    """One re-form at ``world`` ranks: the machine's time and the two encodings'."""
    machine_s, sends, event = capture(world)
    pairs = [(s.rank, s.frame) for s in sends]
    wire, shared_s = seal_all(pairs)
    t0 = time.perf_counter()
    each = [encode_frame(f, _key(r), seq=SEQ) for r, f in pairs]
    each_s = time.perf_counter() - t0
    if wire != each:
        raise SystemExit("bench_reform: the shared bodies sealed other bytes than encode_frame")
    members = [s for s in sends if isinstance(s.frame, NewSession)]
    return {
        "world": world,
        "event": event,
        "members": len(members),
        "new_session_frames": len({id(s.frame) for s in members}),
        "sends": len(sends),
        "bytes": sum(len(w) for w in wire),
        "new_session_bytes": len(wire[sends.index(members[0])]),
        "machine_ms": 1e3 * machine_s,
        "encode_ms": 1e3 * shared_s,
        "encode_each_ms": 1e3 * each_s,
    }


def measure_gaps(world: int) -> dict[str, Any]:
    """The worst member set for the runs: every other rank of ``world`` (a gap after every
    member, as if every odd rank were dead), one ``new_session`` from the coordinator's
    builder to each member, encoded as the server does (no machine: such a set takes
    ``world / 2`` deaths)."""
    members = list(range(0, world, 2))
    frame = built_new_session(1, "bench/s1", members)
    wire, shared_s = seal_all([(r, frame) for r in members])
    return {
        "world": world,
        "members": len(members),
        "runs": len(frame.spans),
        "new_session_bytes": len(wire[0]),
        "bytes": sum(len(w) for w in wire),
        "encode_ms": 1e3 * shared_s,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median ``encode_ms``, carrying every run's (ascending)."""
    ordered = sorted(runs, key=lambda r: r["encode_ms"])
    return ordered[(len(ordered) - 1) // 2] | {
        "encode_ms_runs": [r["encode_ms"] for r in ordered],
    }


def _sizes(r: dict[str, Any]) -> list[str]:
    """The columns both tables share: a member's frame KiB, the wire MiB, the encoding ms."""
    return [
        f"{r['new_session_bytes'] / 1024:.1f}",
        f"{r['bytes'] / 2**20:.1f}",
        f"{r['encode_ms']:.1f}",
    ]


def _per_member(r: dict[str, Any]) -> list[str]:
    """The last two columns of both tables: encoding µs per member, every run's ms."""
    runs = " · ".join(f"{v:.1f}" for v in r["encode_ms_runs"])
    return [f"{1e3 * r['encode_ms'] / r['members']:.1f}", runs]


def _cells(r: dict[str, Any]) -> list[str]:
    sends = f"{r['sends']:,} ({r['members']:,} new_session, {r['new_session_frames']} body)"
    saved = f"{r['encode_each_ms'] / r['encode_ms']:.1f}×"
    return [
        f"{r['world']:,}",
        f"{r['machine_ms']:.1f}",
        sends,
        *_sizes(r),
        f"{r['encode_each_ms']:.1f}",
        saved,
        *_per_member(r),
    ]


GAP_HEADERS = [
    "ranks",
    "members",
    "runs",
    "new_session KiB",
    "wire MiB",
    "encode ms",
    "encode µs per member",
    "encode ms, each run",
]


def _gap_cells(r: dict[str, Any]) -> list[str]:
    return [f"{r['world']:,}", f"{r['members']:,}", f"{r['runs']:,}", *_sizes(r), *_per_member(r)]


HEADERS = [
    "ranks",
    "machine ms",
    "sends",
    "new_session KiB",
    "wire MiB",
    "encode ms",
    "one body per send ms",
    "saved",
    "encode µs per member",
    "encode ms, each run",
]


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    rows = data["rows"]
    lines = [
        *section_head("Re-forming a collective session", data),
        "",
        (
            f"The real pure coordinator driven by `flodl.sim` ({data['mode']}, equal speeds), "
            f"rank W/2 killed at {data['kill_at_s']:g} s of virtual time; timed on the input "
            "that reports the death: `machine ms`, the coordinator's `handle` (the death, "
            "the re-form, the frames built); `encode ms`, its sends turned into wire bytes as "
            "`flodl coord`'s server does (each frame's body encoded once, "
            "`flodl.wire.codec.SharedBodies`, then sealed per connection with its key and "
            "counter); `one body per send ms`, every body encoded on its own (the server's "
            "way before protocol 10, here with protocol 10's frames). `sends` counts the "
            "`declare_dead` to every live rank and the `new_session` to every member. Each "
            f"size ran {data['repeats']} time(s), interleaved; a row is the run with the median "
            "`encode ms`."
        ),
        "",
        *markdown_table(HEADERS, [_cells(r) for r in rows]),
        "",
        (
            "Every member's `new_session` names all members (its rank in the new group is "
            "its position among them, and a shrinking NCCL group needs the list), as runs of "
            "consecutive ranks: after one death, two runs whatever the world size, so the "
            "bytes and the encoding grow linearly with it. What protocol 9 sent (a "
            "`new_rank` and the whole list per member) is measured in docs/design.md §9, "
            '"A re-form at 4,096 ranks".'
        ),
    ]
    gaps = data.get("gaps")
    if gaps:
        lines += [
            "",
            (
                "The worst member set for the runs, a gap after every member (every other "
                "rank, as after a death of every odd rank): one `new_session` built by the "
                "coordinator's builder (`coord/outbound.py`) for each member, encoded as "
                "above. The frame is then as long as the list, so the bytes grow with the "
                "square of the world size again; the body is still encoded once."
            ),
            "",
            *markdown_table(GAP_HEADERS, [_gap_cells(r) for r in gaps]),
        ]
    return "\n".join(lines)


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes wants integers, got {text!r}") from None
    if not sizes or any(s < 4 for s in sizes):
        raise argparse.ArgumentTypeError("--sizes wants world sizes of 4 or more")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=list(SIZES), help="64,512,4096")
    p.add_argument("--repeat", type=int, default=REPEATS, help=f"runs per size ({REPEATS})")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_reform.json")
    add_markdown_option(p, RESULTS_DIR / "bench_reform.json")
    args = p.parse_args(argv)
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    stamp = RunStamp("bench_reform", sys.argv[1:] if argv is None else argv)
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in args.sizes}
    gap_runs: dict[int, list[dict[str, Any]]] = {w: [] for w in args.sizes}
    for _ in range(args.repeat):
        for w in args.sizes:
            runs[w].append(measure(w))
            gap_runs[w].append(measure_gaps(w))
    rows = [median_run(runs[w]) for w in args.sizes]
    gaps = [median_run(gap_runs[w]) for w in args.sizes]
    print_table("re-forming a collective session (one death)", HEADERS, [_cells(r) for r in rows])
    print_table(
        "the worst member set: every other rank", GAP_HEADERS, [_gap_cells(r) for r in gaps]
    )
    data = stamp.header("bench_reform") | {
        "mode": MODE,
        "kill_at_s": KILL_AT_S,
        "repeats": args.repeat,
        "rows": rows,
        "gaps": gaps,
    }
    write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
