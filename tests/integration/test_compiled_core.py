"""The compiled core (docs/design.md §2, "Compiled core"): the wheel a user builds with the
build hook on (``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip wheel .``) compiles the coordinator's hot
path with mypyc, and that build behaves as the sources do.

One build for the module (a few minutes: mypyc, then the C compiler), installed in a scratch
directory that the processes below put first on ``PYTHONPATH`` (each runs outside the
repository, whose sources would otherwise come first)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_standalone import JOIN, STARTS, flodl_env, identical, reap, start_coord, stop

import flodl.coord

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def listed_modules() -> list[str]:
    """The modules hatch_build.py compiles, as dotted names (read, not imported: the hook
    needs hatchling, which only a build environment has)."""
    for node in ast.parse((REPO / "hatch_build.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPILED_MODULES" for t in node.targets
        ):
            paths = ast.literal_eval(node.value)
            return [p.removesuffix(".py").replace("/", ".") for p in paths]
    raise AssertionError("hatch_build.py lists no COMPILED_MODULES")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled wheel, built as a user builds it, installed in a scratch directory (by the
    helper bench_coord builds it with)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        common = importlib.import_module("_common")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
        sys.modules.pop("_common", None)
    target: Path = common.build_compiled_core(tmp_path_factory.mktemp("compiled"), 780)
    (wheel,) = (target.parent / "wheel").glob("flodl-*.whl")
    assert "-cp3" in wheel.name, wheel.name  # a platform wheel, not a pure-Python one
    return target


def on(site: Path) -> dict[str, str]:
    """The environment of a process that runs the compiled build."""
    return os.environ | {"PYTHONPATH": str(site)}


def test_every_module_the_hook_lists_is_compiled(site: Path, tmp_path: Path) -> None:
    modules = listed_modules()
    package = {p.stem for p in (REPO / "flodl" / "coord").glob("*.py")}
    # the coordinator package but for what mypyc does not take as written (hatch_build.py)
    assert package - {m.rsplit(".", 1)[1] for m in modules} == {"__init__", "inputs", "guards"}
    code = (
        "import importlib, json, sys\nimport flodl.coord\n"
        "print(json.dumps({'compiled': flodl.coord.compiled(), "
        "'files': {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *modules],
        env=on(site),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(done.stdout)
    assert found["compiled"] is True
    assert {m: f for m, f in found["files"].items() if not f.endswith(".so")} == {}
    assert all(f.startswith(str(site)) for f in found["files"].values())
    assert flodl.coord.compiled() is False  # the sources this test process runs


def test_flodl_sim_prints_the_same_on_both_builds(site: Path, tmp_path: Path) -> None:
    """The simulator runs the production coordinator: on a heterogeneous rig, in every mode,
    the compiled core makes the same decisions as the sources (same syncs, counts, samples)."""
    cmd = [sys.executable, "-m", "flodl", "sim", "--speeds", "1,1,3", "--json"]
    cmd += ["--seed", "3", "--dataset-len", "4000"]
    compiled = subprocess.run(
        cmd, env=on(site), cwd=tmp_path, capture_output=True, text=True, check=False
    )
    sources = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert compiled.returncode == 0 and sources.returncode == 0, (compiled.stderr, sources.stderr)
    report = json.loads(compiled.stdout)
    modes = {"solo", "nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"}
    assert modes <= set(report) and all(report[m]["ok"] for m in modes)
    assert compiled.stdout == sources.stdout


def test_flodl_coord_on_the_compiled_core_trains_two_ranks(site: Path, tmp_path: Path) -> None:
    """A standalone coordinator says which core it runs; two ranks join it over real sockets
    and train to the end, with the same parameters."""
    env = on(site)
    coord, address = start_coord(tmp_path, "--mode", "cpu_cadence", env=env, cwd=tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            rank_env = flodl_env(address, tmp_path, rank, base=env)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOIN), "--out", str(tmp_path)], env=rank_env, cwd=tmp_path
                )
            )
        assert [p.wait(timeout=200) for p in procs] == [0, 0]
        assert coord.wait(timeout=60) == 0
        identical(tmp_path)
    finally:
        reap(procs)
        out, err = stop(coord)
    assert "compiled core" in STARTS.get(address, ""), (out, err)


def test_the_coordinator_and_simulator_suites_pass_on_the_compiled_core(site: Path) -> None:
    """Every rule the coordinator's unit tests and the simulator's hold the sources to, the
    compiled build is held to as well (one process: the build is imported before pytest
    puts any test folder on the path)."""
    code = (
        "import sys\nimport flodl.coord\n"
        "assert flodl.coord.compiled(), flodl.coord.__file__\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-n', '0', '-p', 'no:cacheprovider', "
        "'tests/unit/coord', 'tests/sim']))"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code],
        check=False,
        env=on(site),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
