"""Every recorded series is named once: its name is written in one string of the package's
code, and every rule, query, dashboard and runbook line that reads it refers to it by that
(``readings.series_of("busy")``, ``promql.STEPPING``). A rename is then one edit, and no
alert can keep reading a series nothing records any more. Docstrings and comments may name a
series to explain it; they are left out.

A family is named where it is exposed (a collector's table, ``training.FAMILIES``, the GPU
metric rows) and in the PromQL that reads it: every raw series the shipped rules, diagnose's
queries and the dashboards read must be one some collector exports (docs/metrics.md is held
to the same list by test_readme.py).
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections import defaultdict

import exporter

ROOT = pathlib.Path(exporter.__file__).parent
# level:metric:operation, as the recording rules name their series
RECORDED = re.compile(r"\b[a-z_]+:gputrain_[a-z_0-9]+:[a-z_0-9]+\b")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module and its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def named(root: pathlib.Path) -> dict[str, list[str]]:
    """Each recorded series' name, by where it is written in a string of code
    (``path:line``) under ``root``."""
    out: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docs:
                for name in RECORDED.findall(node.value):
                    out[name].append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_every_recorded_series_is_named_once_in_the_package():
    repeated = {name: where for name, where in named(ROOT).items() if len(where) > 1}
    assert not repeated, "\n".join(
        f"{name} written {len(where)} times: {', '.join(where)} (name it once and refer to "
        f"it: readings.series_of(field), or a constant beside its rule)"
        for name, where in sorted(repeated.items()))


def test_the_check_finds_a_name_written_twice_and_not_one_explained(tmp_path):
    (tmp_path / "a.py").write_text(
        '"""Reads run_rank:gputrain_training_steps:rate5m."""\n'
        'STEPS = "run_rank:gputrain_training_steps:rate5m"\n'
        '# run_rank:gputrain_training_steps:rate5m, in a comment\n')
    (tmp_path / "b.py").write_text(
        's = "x"\n'
        'RULE = f"sum by (rank) (run_rank:gputrain_training_steps:rate5m{{{s}}})"\n')
    found = named(tmp_path)
    assert found == {"run_rank:gputrain_training_steps:rate5m": ["a.py:2", "b.py:2"]}
    # the package's names are found too: the check reads something
    assert len(named(ROOT)) > 50


# the raw series a family is exposed as: a counter's ``_total``, a histogram's parts
SUFFIXES = ("", "_bucket", "_sum", "_count")
RAW = re.compile(r"(?<![:\w])gputrain_[a-z_0-9]+(?![:\w.])")  # not a name regex


def read_families(text: str) -> set[str]:
    """The raw series a rule, query or panel text reads (recorded series left out)."""
    return set(RAW.findall(text))


def test_every_series_a_rule_a_query_or_a_panel_reads_is_exported():
    """A family renamed in the exposition and not in the rules leaves an alert that reads
    nothing and so never fires: every raw series the shipped rules, diagnose's queries and the
    dashboards read is one some collector exports."""
    from test_readme import exported

    from exporter.heuristics.diagnose import fault_queries, queries
    from exporter.heuristics.promql import Identity

    served = {name + suffix for name in exported() for suffix in SUFFIXES}
    ids = Identity()
    texts = {str(p.relative_to(ROOT.parent)): p.read_text()
             for p in [*(ROOT.parent / "alerts").glob("*.yml"),
                       *(ROOT.parent / "grafana" / "dashboards").glob("*.json")]}
    texts["diagnose"] = "\n".join([*queries('job="x"', "5m", ids).values(),
                                   *fault_queries('job="x"', ids, "5m").values()])
    assert len(texts) > 4
    unknown = {where: sorted(read_families(text) - served) for where, text in texts.items()}
    assert not any(unknown.values()), {k: v for k, v in unknown.items() if v}


def test_the_family_check_sees_a_raw_series_and_not_a_recorded_one():
    text = ('rate(gputrain_training_steps_total{job="x"}[5m]) / '
            'run_rank:gputrain_training_steps:rate5m and gputrain_gpu_up_bucket')
    assert read_families(text) == {"gputrain_training_steps_total", "gputrain_gpu_up_bucket"}
