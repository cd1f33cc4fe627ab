"""The import graph: no cycle between modules, and no import running up a layer.

The layers, lowest first: the push protocol and the terminal helpers; what the daemon reads
(``reading``); its flags (``config``); the heuristics; what it serves (``serving``); the
commands (``cli``). The training client (``client``) runs inside the training process: it
reads the protocol, the host's process table and the terminal helpers, nothing of the daemon.
Imports under ``if TYPE_CHECKING:`` are for the type checker only and are left out.
"""

from __future__ import annotations

import ast
import pathlib

import exporter

ROOT = pathlib.Path(exporter.__file__).parent
ALLOWED = {  # each part of the package -> the parts it may import
    "exporter": set(),
    "protocol": set(),
    "terminal": {"protocol"},
    "reading": {"exporter", "protocol"},
    "config": {"protocol", "reading"},
    "heuristics": {"exporter", "protocol", "terminal", "reading", "config"},
    "serving": {"exporter", "protocol", "terminal", "reading", "config", "heuristics"},
    "client": {"exporter", "protocol", "terminal", "reading"},
    "cli": {"exporter", "protocol", "terminal", "reading", "config", "heuristics", "serving",
            "client"},
    "__main__": {"cli"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("exporter", *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project's modules ``path`` imports at run time."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "exporter":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "exporter")
    return out & set(modules)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "exporter"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def test_every_part_of_the_package_has_a_layer():
    assert {_part(m) for m in _modules()} == set(ALLOWED)


def test_no_import_runs_up_a_layer():
    wrong = sorted(f"{a} imports {b}" for a, targets in _graph().items() for b in targets
                   if _part(a) != _part(b) and _part(b) not in ALLOWED[_part(a)])
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` meets, as the modules along it."""
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_two_modules_import_each_other_even_through_others():
    assert _cycles(_graph()) == []


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The near miss the checks exist for: a reading module importing the serving layer, and
    two modules importing each other, are both found."""
    pkg = tmp_path / "exporter"
    (pkg / "reading").mkdir(parents=True)
    (pkg / "serving").mkdir()
    for f in ("__init__.py", "reading/__init__.py", "serving/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "reading" / "a.py").write_text("from exporter.serving.b import X\n")
    (pkg / "serving" / "b.py").write_text("from exporter.reading import a\nX = 1\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph = _graph()
    assert graph["exporter.reading.a"] == {"exporter.serving.b"}
    assert graph["exporter.serving.b"] == {"exporter.reading.a"}
    with_error = [f"{a} imports {b}" for a, t in graph.items() for b in t
                  if _part(b) not in ALLOWED[_part(a)] and _part(a) != _part(b)]
    assert with_error == ["exporter.reading.a imports exporter.serving.b"]
    assert _cycles(graph) == [["exporter.reading.a", "exporter.serving.b", "exporter.reading.a"]]
