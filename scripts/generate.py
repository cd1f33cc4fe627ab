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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="only list the stale files; exit 1 if there are any")
    ns = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from exporter.heuristics.generate import committed, stale

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
