"""Architecture rules that code review alone would miss (docs/design.md §0).

* the import graph of ``flodl`` has no cycle (lazy imports inside functions included; imports
  under ``TYPE_CHECKING`` are types only and do not count);
* no module imports from a higher layer than its own;
* the pure core (foundation, coordinator, rank protocol, simulator) pulls in no I/O, clock,
  thread or torch, directly or through anything it imports;
* no module but :mod:`flodl.modes` compares mode, policy or backend names;
* no module is longer than :data:`MAX_LINES` unless docs/design.md names it and says why;
* comments and docstrings cite only documents of this repository (``docs/design.md §2``).

Each checker is also shown to catch a planted violation.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "flodl"
FORBIDDEN = {"asyncio", "socket", "threading", "time", "torch", "subprocess", "os", "selectors"}
MAX_LINES = 750

LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundation",
        [
            "flodl.errors",
            "flodl.checks",
            "flodl.modes",
            "flodl.placement",
            "flodl.timeouts",
            "flodl.sampling",
            "flodl.config",
            "flodl.wire",
            "flodl.wire.frames",
            "flodl.wire.codec",
            "flodl.wire.control_hello",
        ],
    ),
    ("core", ["flodl.coord", "flodl.coord.*", "flodl.rank.protocol", "flodl.rank.step_clock"]),
    ("simulator", ["flodl.sim", "flodl.sim.*"]),
    (
        "io",
        [
            "flodl.wire.stream",
            "flodl.wire.tensors",
            "flodl.wire.tensor_read",
            "flodl.wire.data_hello",
            "flodl.wire.shm",
            "flodl.wire.shm_segment",
            "flodl.data",
            "flodl.outer",
            "flodl.checkpoint",
            "flodl.checkpoint.*",
            "flodl.chaos",
            "flodl.monitor",
            "flodl.monitor.*",
            "flodl.launch",
            "flodl.launch.cluster",
            "flodl.launch.cluster_file",
            "flodl.launch.builder",
            "flodl.launch.gpus",
            "flodl.launch.env",
            "flodl.launch.crash_trace",
        ],
    ),
    (
        "shells",
        ["flodl.service", "flodl.service.*", "flodl.rank", "flodl.rank.*", "flodl.launch.ssh"],
    ),
    (
        "tiers",
        [
            "flodl.local",
            "flodl.handle",
            "flodl.trainer_config",
            "flodl.launch.child",
            "flodl.launch.launcher",
            "flodl.worker",
        ],
    ),
    (
        "entry",
        [
            "flodl",
            "flodl.trainer",
            "flodl.demo",
            "flodl.demo.*",
            "flodl.cli",
            "flodl.coord_cli",
            "flodl.sim_cli",
            "flodl.__main__",
        ],
    ),
]
"""Layers from the bottom up; a module may import its own layer and those below."""
PURE_LAYERS = {"foundation", "core", "simulator"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path, modules: Iterable[str]) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level external roots imported), anywhere in the file."""
    known = set(modules)
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_lines(tree)
    internal: set[str] = set()
    external: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flodl":
                    internal.add(alias.name)
                else:
                    external.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "flodl":
                external.add(node.module.split(".")[0])
                continue
            for alias in node.names:  # `from flodl import checkpoint` imports a submodule
                sub = f"{node.module}.{alias.name}"
                internal.add(sub if sub in known else node.module)
    return internal & known, external


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module → package modules it imports, module → external roots it imports)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in modules.items():
        internal, ext = _imports(path, modules)
        graph[name] = internal - {name}
        external[name] = ext
    return graph, external


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return index
    raise AssertionError(f"{module} is in no layer of tests/unit/test_arch.py: place it")


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    return [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if layer_of(b) > layer_of(a)
    ]


def impure_closure(
    graph: Mapping[str, set[str]], external: Mapping[str, set[str]], module: str
) -> dict[str, str]:
    """Forbidden roots reachable from ``module``, each with the module that imports it."""
    seen, todo = {module}, [module]
    found: dict[str, str] = {}
    while todo:
        current = todo.pop()
        for root in sorted(external.get(current, set()) & FORBIDDEN):
            found.setdefault(root, current)
        for nxt in graph.get(current, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return found


MODE_WORDS = {
    "nccl_sync",
    "nccl_cadence",
    "cpu_sync",
    "cpu_cadence",
    "cpu_async",
    "sync",
    "cadence",
    "async",
    "collective",
    "cpu",
    "cpu_",
}
_MODE_CONTEXT = re.compile(r"mode|policy|backend|traits")


def mode_comparisons(source: str) -> list[str]:
    """Comparisons of a mode, policy or backend name (``"cpu"`` only next to a mode-ish
    name: it is also a device)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        consts: list[str] = []
        others: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in MODE_WORDS:
                    consts.append(operand.value)
                elif isinstance(operand, ast.Tuple | ast.Set | ast.List):
                    consts += [
                        e.value
                        for e in operand.elts
                        if isinstance(e, ast.Constant) and e.value in MODE_WORDS
                    ]
                else:
                    others.append(operand)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
        ):
            consts = [
                a.value for a in node.args if isinstance(a, ast.Constant) and a.value in MODE_WORDS
            ]
            others = [node.func.value]
        elif (
            isinstance(node, ast.MatchValue)
            and isinstance(node.value, ast.Constant)
            and node.value.value in MODE_WORDS
        ):
            consts = [node.value.value]
            others = []
        if not consts:
            continue
        context = " ".join(ast.unparse(o) for o in others)
        if set(consts) == {"cpu"} and others and not _MODE_CONTEXT.search(context):
            continue  # a device
        assert isinstance(node, ast.expr | ast.pattern)  # Compare, Call or MatchValue
        found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
    return found


# ---------------------------------------------------------------------------------------------


GRAPH, EXTERNAL = import_graph()


def test_every_module_is_in_a_layer() -> None:
    for module in GRAPH:
        layer_of(module)


def test_the_import_graph_has_no_cycle() -> None:
    assert find_cycle(GRAPH) is None, find_cycle(GRAPH)


def test_no_module_imports_from_a_higher_layer() -> None:
    assert upward_imports(GRAPH) == []


@pytest.mark.parametrize(
    "module", sorted(m for m in GRAPH if LAYERS[layer_of(m)][0] in PURE_LAYERS)
)
def test_a_pure_module_pulls_in_no_io_transitively(module: str) -> None:
    bad = impure_closure(GRAPH, EXTERNAL, module)
    assert not bad, f"{module} is pure but reaches {bad} (root: importing module)"


def test_no_module_but_modes_compares_mode_names() -> None:
    found = {
        name: hits
        for name, path in _modules().items()
        if name != "flodl.modes" and (hits := mode_comparisons(path.read_text()))
    }
    assert found == {}


def test_long_modules_are_explained_in_the_design() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    long = {
        str(path.relative_to(REPO)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    unexplained = {p: n for p, n in long.items() if f"`{p}`" not in design}
    assert unexplained == {}, f"modules over {MAX_LINES} lines not named in docs/design.md"


# --- the checkers catch what they look for ----------------------------------------------------


def test_checkers_catch_planted_violations(tmp_path: Path) -> None:
    pkg = tmp_path / "flodl"
    (pkg / "coord").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "coord" / "__init__.py").write_text("")
    # a pure coordinator module that reaches torch through the trainer, which imports it back
    (pkg / "coord" / "machine.py").write_text("from flodl import trainer\n")
    (pkg / "trainer.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncio\n"
        "def run():\n    import torch\n    from flodl.coord.machine import x\n"
    )
    graph, external = import_graph(pkg)
    assert graph == {
        "flodl": set(),
        "flodl.coord": set(),
        "flodl.coord.machine": {"flodl.trainer"},
        "flodl.trainer": {"flodl.coord.machine"},
    }
    assert external["flodl.trainer"] == {"typing", "torch"}  # not asyncio: types only
    assert find_cycle(graph) == ["flodl.coord.machine", "flodl.trainer", "flodl.coord.machine"]
    assert upward_imports(graph) == ["flodl.coord.machine (core) imports flodl.trainer (entry)"]
    assert impure_closure(graph, external, "flodl.coord.machine") == {"torch": "flodl.trainer"}


def test_mode_checker_catches_a_planted_comparison() -> None:
    planted = (
        'if config.elche.policy == "sync": pass\n'
        'if mode in ("cpu_sync", "x"): pass\n'
        'if el.backend != "cpu": pass\n'
        'if m.startswith("cpu_"): pass\n'
        'if device == "cpu": pass\n'
    )
    found = mode_comparisons(planted)
    assert [f.split(":")[0] for f in found] == ["line 1", "line 2", "line 3", "line 4"]


# --- comments cite this repository ------------------------------------------------------------

OUTSIDE = re.compile(r"\b(?:STYLE|DESIGN|EXAMPLES)(?:\.md)?\b|flodl-spec|\.\./shared")
CITED_BY = ("design.md", "reliability.md", "security-notes.md", "benchmarks.md", "RFC")


def outside_citations(text: str) -> list[str]:
    """References a reader of this repository cannot follow: texts outside it by name, and
    ``§`` sections not preceded (within the same sentence, across a line wrap) by the document
    of this repository they belong to."""
    flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # join wrapped lines (and comment lines)
    found = [f"{m.group(0)!r}" for m in OUTSIDE.finditer(flat)]
    for m in re.finditer("§", flat):
        before = flat[max(0, m.start() - 40) : m.start()]
        if not any(doc in before for doc in CITED_BY):
            found.append(f"{flat[max(0, m.start() - 20) : m.start() + 6]!r}")
    return found


def test_comments_cite_only_this_repository() -> None:
    files = [
        p
        for top in ("flodl", "tests", "benchmarks", "examples")
        for p in (REPO / top).rglob("*.py")
    ]
    found = {
        str(p.relative_to(REPO)): hits
        for p in files
        if p.name != "test_arch.py" and (hits := outside_citations(p.read_text()))
    }
    assert found == {}


def test_the_citation_checker_catches_planted_references() -> None:
    planted = (
        "# go to the lowest rank (STYLE §0.5)\n"
        "x = 1  # see DESIGN.md\n"
        '"""over all tensors (§3.1)."""\n'
        "# fine: docs/design.md §2, and docs/design.md\n#   §4 across a wrap; RFC 9112 §2.2\n"
    )
    found = outside_citations(planted)
    assert found[:2] == ["'STYLE'", "'DESIGN.md'"]  # by name
    assert len(found) == 4 and "STYLE §0.5" in found[2] and "(§3.1)" in found[3]  # bare §


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename from the rootdir (tests/ has no packages), so
    two ``test_x.py`` in different folders fail the collection of the whole suite."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(REPO)} and {path.relative_to(REPO)}")
        seen.setdefault(path.name, path)
    assert clashes == []
