"""The suite starts the project from the environment under test, never from PATH.

A test that runs a bare ``python3`` gets whatever interpreter comes first on PATH (Debian's
own, on a clean machine, without the project's dependencies); one that looks the
``gputrain-exporter`` command up on PATH misses the venv's. Both passed on machines where
the dependencies had been installed by hand, and failed on a clean one.
"""

from __future__ import annotations

import ast

from conftest import ROOT

BARE_INTERPRETERS = {"python", "python3", "python3.10", "python3.11", "python3.12", "python3.13"}
PROJECT_COMMANDS = {"gputrain-exporter"}
STARTERS = {"run", "Popen", "call", "check_call", "check_output", "execv", "execvp"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def reaches_outside(source: str) -> list[tuple[int, str]]:
    """(line, what) for each process started from a bare interpreter name or a project
    command found on PATH."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        name = _name(node.func)
        if name in STARTERS and isinstance(first, (ast.List, ast.Tuple)) and first.elts:
            head = first.elts[0]
            if isinstance(head, ast.Constant) and head.value in BARE_INTERPRETERS | \
                    PROJECT_COMMANDS:
                found.append((node.lineno, f"starts {head.value!r} from PATH"))
        if name == "which" and isinstance(first, ast.Constant) and \
                first.value in BARE_INTERPRETERS | PROJECT_COMMANDS:
            found.append((node.lineno, f"looks {first.value!r} up on PATH"))
    return found


def test_the_check_finds_what_it_looks_for():
    assert reaches_outside('subprocess.run(["python3", "-m", "exporter"])') == [
        (1, "starts 'python3' from PATH")]
    assert reaches_outside('shutil.which("gputrain-exporter")') == [
        (1, "looks 'gputrain-exporter' up on PATH")]
    assert reaches_outside('subprocess.run([sys.executable, "-m", "exporter"])') == []
    assert reaches_outside('shutil.which("promtool")') == []


def test_no_test_or_benchmark_starts_the_project_from_path():
    offenders = []
    for folder in ("tests", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, what in reaches_outside(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert offenders == [], "use sys.executable or conftest.ENV_BIN:\n" + "\n".join(offenders)
