"""Rewrite every committed file made from the catalogue (developers, in a checkout).

The rule files, the PrometheusRule, the promtool rule tests (from tests/rule_cases.py), the
dashboards and their ConfigMap, the runbook and the generated tables of docs/. ``--check``
only lists the stale ones and exits 1 (tests/test_rules.py fails on them too). Users who want
the rules or dashboards with their own thresholds run ``gputrain-exporter rules --config`` and
``gputrain-exporter dashboards --config``; this script is for the repository's own files.

    .venv/bin/python scripts/generate.py [--check]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rule_cases(root: Path):
    """tests/rule_cases.py of the checkout (it writes the promtool tests)."""
    if "rule_cases" in sys.modules:  # the test suite has it already
        return sys.modules["rule_cases"]
    spec = importlib.util.spec_from_file_location("rule_cases", root / "tests" / "rule_cases.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(root / "tests" / "rule_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rule_cases"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def committed(root: Path = ROOT) -> dict[Path, Callable[[], str]]:
    """Every generated file of the checkout at ``root``, and how to make its content."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from exporter import protocol
    from exporter.heuristics import dashboards
    from exporter.heuristics.generate import (
        alert_table,
        decision_order,
        replace_block,
        runbook,
        threshold_table,
    )
    from exporter.heuristics.rules import render, render_prometheusrule
    from exporter.reading import gpu_metrics

    alerts_page = root / "docs" / "alerts.md"
    diagnose_page = root / "docs" / "diagnose.md"
    metrics_page = root / "docs" / "metrics.md"
    push_page = root / "docs" / "push-protocol.md"

    def alerts_page_text() -> str:
        text = replace_block(alerts_page.read_text(), "alert table", alert_table())
        return replace_block(text, "threshold table", threshold_table())

    files: dict[Path, Callable[[], str]] = {
        root / "alerts" / "gputrain.rules.yml": render,
        root / "alerts" / "gputrain.node.rules.yml": lambda: render(level="node"),
        root / "alerts" / "gputrain.global.rules.yml": lambda: render(level="global"),
        root / "deploy" / "kubernetes" / "prometheusrule.yaml": render_prometheusrule,
        root / "alerts" / "runbook.md": runbook,
        root / "deploy" / "kubernetes" / "dashboards-configmap.yaml": dashboards.configmap,
        alerts_page: alerts_page_text,
        diagnose_page: lambda: replace_block(diagnose_page.read_text(), "decision order",
                                             decision_order()),
        metrics_page: lambda: replace_block(metrics_page.read_text(), "GPU metric table",
                                            gpu_metrics.doc_table()),
        push_page: lambda: replace_block(push_page.read_text(), "push fields",
                                         protocol.field_table()),
    }
    for name, d in dashboards.dashboards().items():
        files[root / "grafana" / "dashboards" / name] = partial(dashboards.render, d)
    for path, text in _rule_cases(root).files().items():
        files[path] = partial(str, text)
    return files


def stale(root: Path = ROOT) -> list[Path]:
    """The generated files whose committed content differs from what this script writes."""
    return [p for p, make in committed(root).items()
            if not p.exists() or p.read_text() != make()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="only list the stale files; exit 1 if there are any")
    ns = p.parse_args(argv)
    if ns.check:
        old = stale(ROOT)
        for path in old:
            print(f"stale: {path.relative_to(ROOT)}")
        return 1 if old else 0
    for path, make in committed(ROOT).items():
        text = make()
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
