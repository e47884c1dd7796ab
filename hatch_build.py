"""Build hook: the coordinator's hot path compiled with mypyc (docs/design.md §2, "Compiled core").

Off by default. ``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip install .`` (or ``pip wheel``) builds a
wheel whose :data:`COMPILED_MODULES` are C extensions, next to their sources; everything else,
and every other build, is the plain Python package. An editable install is refused with the
hook on: a compiled module shadows its source, so an edit would silently not run.

The sources are copied to a temporary directory and compiled there (the tree is never written
to); mypyc type-checks them with a minimal configuration (the project's strict one, with the
pydantic plugin, lives in pyproject.toml and runs in CI; here the modules it follows are read
for their types and not checked), then the extensions are added to the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

COMPILED_MODULES = (
    # what every per-rank frame and every averaging cycle runs through
    "flodl/coord/machine.py",
    "flodl/coord/dispatch.py",
    "flodl/coord/ledger.py",
    "flodl/coord/averaging.py",
    "flodl/coord/elche.py",
    "flodl/coord/elche_state.py",
    "flodl/coord/partition.py",
    "flodl/coord/gate.py",
    "flodl/coord/liveness.py",
    "flodl/coord/membership.py",
    "flodl/coord/cycle.py",
    "flodl/coord/contribution.py",
    "flodl/coord/metrics.py",
    "flodl/coord/reporting.py",
    "flodl/coord/effects.py",
    "flodl/coord/outbound.py",
    # what a cycle calls once
    "flodl/coord/phases.py",
    "flodl/coord/verdicts.py",
    "flodl/coord/callbacks.py",
    "flodl/coord/roles.py",
    "flodl/coord/admission.py",
    "flodl/coord/meta.py",
    "flodl/coord/rounds.py",
    "flodl/coord/resume.py",
)
"""The coordinator package (docs/design.md §2, "Compiled core") but for two modules mypyc does
not take as written: ``inputs`` (a ``ClassVar`` in a slotted dataclass) and ``guards`` (a
runtime-checkable ``Protocol``), neither on a per-rank path; tests/integration/
test_compiled_core.py checks that each listed module loads compiled."""

_MYPY_CONFIG = """\
[mypy]
python_version = 3.11
ignore_missing_imports = True
follow_imports = silent

[mypy-torch.*]
follow_imports = skip
"""
"""mypyc's configuration. torch is not followed: the compiled modules use none of its types
(the coordinator is pure), and reading its 2,500 modules was most of the build (75 s of C
generation here, 6 s without; the C generated is byte-identical either way)."""


class CompiledCoreHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if version == "editable":
            raise RuntimeError(
                "flodl: the compiled core (HATCH_BUILD_HOOK_ENABLE_CUSTOM) builds a regular "
                "wheel; an editable install runs the sources, where a compiled module would "
                "shadow every edit. Install without -e, or unset the variable."
            )
        work = Path(tempfile.mkdtemp(prefix="flodl-mypyc-"))
        self._work = work
        try:
            built = self._compile(work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)  # (finalize does it after a build)
            raise
        build_data["force_include"].update(built)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def _compile(self, work: Path) -> dict[str, str]:
        """Compile the listed modules in ``work``: {extension's path: its path in the wheel}."""
        shutil.copytree(
            Path(self.root) / "flodl",
            work / "flodl",
            ignore=shutil.ignore_patterns("__pycache__", "*.so"),
        )
        (work / "mypy.ini").write_text(_MYPY_CONFIG)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")}
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *COMPILED_MODULES],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"flodl: mypyc failed to compile the core:\n{done.stdout}")
        built = {}
        for module in COMPILED_MODULES:
            stem = Path(module).with_suffix("")
            found = sorted(work.glob(f"{stem}.*.so")) + sorted(work.glob(f"{stem}.*.pyd"))
            if not found:
                raise RuntimeError(f"flodl: mypyc produced no extension for {module}")
            built[str(found[0])] = str(found[0].relative_to(work))
        # the shared runtime of a multi-module build (a top-level module, ``<hash>__mypyc``)
        for shared in [*work.glob("*__mypyc.*.so"), *work.glob("*__mypyc.*.pyd")]:
            built[str(shared)] = shared.name
        return built

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        work = getattr(self, "_work", None)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
