"""Small helpers shared by the benchmark scripts: a best-of timer, a text table, JSON output.

Every script in ``benchmarks/`` prints a table and writes JSON; a comparison is always two
systems measured in the same run and reported as a ratio (this machine is shared and noisy).
Scripts run as ``python benchmarks/<name>.py``; call :func:`ensure_repo_on_path` before
importing ``flodl`` or ``benchmarks.*`` so that works without an installed package.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "ensure_repo_on_path",
    "best_of",
    "rate",
    "format_cell",
    "print_table",
    "write_json",
    "machine_info",
    "add_markdown_option",
    "run_line",
    "RunStamp",
    "package_versions",
    "section_head",
    "markdown_table",
    "met_text",
    "span_text",
    "read_records",
    "wait_for",
    "median_stats",
    "stats_cell",
    "repeat_trials",
    "run_in_group",
    "CpuMeter",
    "build_compiled_core",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def ensure_repo_on_path() -> None:
    """Put the repository root first on ``sys.path`` (scripts run from ``benchmarks/``)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def best_of(fn: Callable[[], object], repeat: int = 5, *, warmup: int = 1) -> float:
    """Shortest wall time of ``repeat`` calls of ``fn``, in seconds, after ``warmup`` calls.

    The minimum is the least noisy estimate on a shared machine: noise only ever adds time.
    """
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def rate(count: int, seconds: float) -> float:
    """``count`` operations in ``seconds`` as operations per second (``inf`` for 0 s)."""
    return count / seconds if seconds > 0 else math.inf


def format_cell(value: object) -> str:
    """A table cell: floats with 3 significant digits (thousands separated), ints grouped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and abs(value) < 1:
            return f"{value:.3g}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print ``rows`` under ``headers`` as an aligned text table (first column left-aligned)."""
    cells = [[format_cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells for {len(headers)} headers: {row}")
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    print(f"\n{title}")
    print(line(list(headers)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path``, creating parent directories; return the path.

    Non-finite floats are written as strings (``"inf"``, ``"nan"``) so the file is strict JSON.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(obj), indent=2, sort_keys=False) + "\n")
    return out


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def machine_info() -> dict[str, Any]:
    """Where the figures came from: interpreter, OS, CPU count."""
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def processes_with(tag: str) -> list[int]:
    """Pids of the processes whose command line holds ``tag`` (a run's tag argument)."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True
    )
    pids = []
    for line in out.stdout.splitlines():
        if tag in line and "ps -ww" not in line:
            pids.append(int(line.split()[0]))
    return pids


def rank_pid(tag: str, rank: int) -> int | None:
    """The pid of rank ``rank`` of the run tagged ``tag`` (by its ``FLODL_RANK``)."""
    for pid in processes_with(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"FLODL_RANK={rank}".encode() in env:
            return pid
    return None


def uptime() -> str:
    """``uptime``'s line (the machine's load), or ``n/a``."""
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return "n/a"


class CpuMeter:
    """The machine's cores busy over a stretch, split into this process tree's and everyone
    else's: started at construction, read by :meth:`stop`.

    The machine's figure is ``/proc/stat`` (user, nice, system, irq, softirq and steal time of
    every CPU); this tree's is ``getrusage`` of this process and of its children that were waited
    for (a child still running when :meth:`stop` is called counts as someone else's). ``other``
    is the load that competed with the run from outside it.
    """

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float | None, float, float]:
        """(monotonic, machine busy CPU-seconds or None, own CPU-seconds, steal CPU-seconds)."""
        import resource

        machine: float | None = None
        steal = 0.0
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            tick = float(os.sysconf("SC_CLK_TCK"))
            user, nice, system, _idle, _iowait, irq, softirq, st = fields[:8]
            machine = (user + nice + system + irq + softirq + st) / tick
            steal = st / tick
        except (OSError, ValueError):
            pass
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        return time.monotonic(), machine, own, steal

    def stop(self) -> dict[str, float | None]:
        """Mean cores over the stretch: ``machine``, ``own``, ``other`` (machine − own, ≥ 0)
        and ``steal`` (CPU time the hypervisor gave to other guests); None where
        ``/proc/stat`` is unreadable."""
        t1, m1, o1, s1 = self._read()
        t0, m0, o0, s0 = self._start
        wall = max(1e-9, t1 - t0)
        own = (o1 - o0) / wall
        if m0 is None or m1 is None:
            return {"machine": None, "own": own, "other": None, "steal": None}
        machine = (m1 - m0) / wall
        return {
            "machine": machine,
            "own": own,
            "other": max(0.0, machine - own),
            "steal": (s1 - s0) / wall,
        }


class CoordinatorView:
    """A coordinator as the simulator sees it, with some methods replaced (``handle``,
    ``tick``: timed wrappers); every other attribute is the coordinator's. (Patching the
    instance's methods instead does not work on the compiled core, whose classes have no
    instance dictionary.)"""

    def __init__(self, coord: Any, **methods: Callable[..., Any]) -> None:
        object.__setattr__(self, "_coord", coord)
        for name, method in methods.items():
            object.__setattr__(self, name, method)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coord, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._coord, name, value)


def add_markdown_option(parser: Any, default_json: str | os.PathLike[str]) -> None:
    """``--markdown [JSON]``: print the script's docs/benchmarks.md section for a result file
    (default ``default_json``) and exit."""
    parser.add_argument(
        "--markdown",
        nargs="?",
        const=str(default_json),
        default=None,
        metavar="JSON",
        help="print the docs section for a result file and exit (default: %(const)s)",
    )


def run_line(data: dict[str, Any], detail: str = "") -> str:
    """A docs section's first line: when it ran (``date``), ``detail``, and the load before and
    after (``uptime``), all from the result file."""
    extra = f", {detail}" if detail else ""
    return (
        f"Run {data['date']} (`date`){extra}. `uptime` before: `{data['uptime_before']}`; "
        f"after: `{data['uptime_after']}`."
    )


class RunStamp:
    """When, how and under what load a benchmark ran: taken as the run starts, closed by
    :meth:`header` as it ends."""

    def __init__(self, script: str, argv: Sequence[str]) -> None:
        self.command = shlex.join(["python", f"benchmarks/{script}.py", *argv])
        self.date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self.uptime_before = uptime()
        self.started = time.perf_counter()

    def header(self, benchmark: str, *packages: str) -> dict[str, Any]:
        """A result file's first keys: ``benchmark``, ``command`` (``python benchmarks/<script>.py
        <args>``), ``date`` (UTC, at the start), ``uptime_before``/``uptime_after``, ``took_s``
        (wall seconds since the start), ``machine`` and ``versions`` (of ``packages``)."""
        return {
            "benchmark": benchmark,
            "command": self.command,
            "date": self.date,
            "uptime_before": self.uptime_before,
            "uptime_after": uptime(),
            "took_s": time.perf_counter() - self.started,
            "machine": machine_info(),
            "versions": package_versions(*packages),
        }


def package_versions(*names: str) -> dict[str, str | None]:
    """Each installed distribution's version by name (None where it is not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def section_head(title: str, data: dict[str, Any], detail: str = "") -> list[str]:
    """A generated docs section's opening lines: ``## <title> (`<command>`)``, a blank line, then
    :func:`run_line` with the machine (CPUs, Python) and the ``versions`` of the result file."""
    machine = data["machine"]
    versions = ", ".join(f"{k} {v or 'absent'}" for k, v in data.get("versions", {}).items())
    return [
        f"## {title} (`{data['command']}`)",
        "",
        (
            f"{run_line(data, detail)} Machine: {machine.get('cpus', '?')} CPUs, Python "
            f"{machine.get('python', '?')}" + (f"; {versions}." if versions else ".")
        ),
    ]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """``rows`` under ``headers`` as the lines of a Markdown pipe table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def met_text(met: bool | None) -> str:
    """A target's verdict in a docs section: ``**met**``, ``**not met**`` or ``n/a`` (None)."""
    return "n/a" if met is None else ("**met**" if met else "**not met**")


def span_text(values: Iterable[float | None], fmt: str = ".2f") -> str:
    """The range of the values that are not None as ``lo–hi`` (one value when they are equal,
    ``-`` when there is none)."""
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    lo, hi = format(min(got), fmt), format(max(got), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON record (an object with a ``ts``) of one JSONL file; a torn last line
    is skipped, a missing file gives none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "ts" in rec:
            out.append(rec)
    return out


def wait_for(pred: Callable[[], Any], timeout_s: float, poll_s: float = 0.1) -> Any:
    """``pred()``'s first truthy value, polled every ``poll_s`` for ``timeout_s``; None after."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    return None


def median_stats(values: Iterable[float | None]) -> dict[str, Any]:
    """``median``, ``min``, ``max`` and ``n`` of the values that are not None (None, 0 if none)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def stats_cell(s: dict[str, Any], fmt: str = ".2f", scale: float = 1.0) -> str:
    """A :func:`median_stats` result as ``median (min–max)`` (the median alone for one value,
    ``-`` for none), each value multiplied by ``scale``."""
    if s["median"] is None:
        return "-"
    med, lo, hi = (_unsigned_zero(format(s[k] * scale, fmt)) for k in ("median", "min", "max"))
    return med if s["n"] == 1 else f"{med} ({lo}–{hi})"


def _unsigned_zero(text: str) -> str:
    """A formatted number without the sign of a value that rounds to zero (``-0`` → ``0``)."""
    return text[1:] if text.startswith("-") and float(text) == 0.0 else text


def repeat_trials(
    label: str,
    n: int,
    trial: Callable[[], dict[str, Any]],
    brief: Callable[[dict[str, Any]], str],
    into: list[dict[str, Any]],
) -> None:
    """Run ``trial`` ``n`` times, appending each result to ``into`` and printing
    ``  <label>: <brief(result)>`` as it comes."""
    for _ in range(n):
        result = trial()
        into.append(result)
        print(f"  {label}: {brief(result)}", flush=True)


def run_in_group(cmd: Sequence[str], timeout_s: float, **popen: Any) -> tuple[int | None, Any, Any]:
    """Run ``cmd`` in a process group of its own: ``(exit status, or None when it ran past
    ``timeout_s``; stdout; stderr)`` as :meth:`subprocess.Popen.communicate` gives them
    (``popen`` goes to ``Popen``: ``stdout``, ``stderr``, ``cwd``, ``env``, ``text``).

    The status is the command's own, taken when it exits: a child it left behind (a rank of a
    finished launcher) may hold its pipes open, so the output is read on a thread while this
    one waits. The whole group is then killed, after the command ends, times out or the caller
    is interrupted, so no child of it outlives it and every read ends."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    got: list[Any] = [None, None]

    def read() -> None:
        got[0], got[1] = proc.communicate()

    reader = threading.Thread(target=read, name="run-in-group", daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
    return code, got[0], got[1]


def build_compiled_core(
    scratch: Path, timeout_s: float | None = None, source: Path = REPO_ROOT
) -> Path:
    """The compiled core built as a user builds it (``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip wheel
    .``; docs/design.md §2, "Compiled core") from ``source`` (the repository, or another
    revision's tree), installed under ``scratch``; returns the directory to put first on
    ``sys.path``. The build runs at a low priority: minutes of C compiler on a core that other
    work (a test worker, say) may share. Used by bench_coord and
    tests/integration/test_compiled_core.py."""
    wheels, site = scratch / "wheel", scratch / "site"
    env = os.environ | {"HATCH_BUILD_HOOK_ENABLE_CUSTOM": "1"}
    pip = [sys.executable, "-m", "pip", "-q"]
    build = ["nice", "-n", "10", *pip, "wheel", "--no-deps", "-w", str(wheels), str(source)]
    subprocess.run(build, env=env, check=True, timeout=timeout_s)
    (wheel,) = wheels.glob("flodl-*.whl")
    install = [*pip, "install", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, timeout=timeout_s)
    return site
