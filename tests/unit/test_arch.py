"""Architecture rules that code review alone would miss."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "flodl"
FORBIDDEN = {"asyncio", "socket", "threading", "time", "torch", "subprocess", "os", "selectors"}
SHELLS = {"server.py", "reduce.py", "store.py", "service.py"}


def _pure_modules() -> list[Path]:
    pure = [ROOT / "wire" / "frames.py", ROOT / "wire" / "codec.py"]
    pure += [p for p in sorted((ROOT / "coord").glob("*.py")) if p.name not in SHELLS]
    pure += sorted((ROOT / "sim").glob("*.py")) if (ROOT / "sim").is_dir() else []
    return pure


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_pure_module_list_is_not_empty() -> None:
    assert len(_pure_modules()) >= 2


@pytest.mark.parametrize("path", _pure_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_does_no_io(path: Path) -> None:
    bad = _imported_roots(path) & FORBIDDEN
    assert not bad, f"{path.relative_to(ROOT)} is pure but imports {sorted(bad)}"


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os.path\nfrom time import monotonic\nimport msgpack\n")
    assert _imported_roots(probe) & FORBIDDEN == {"os", "time"}
