"""The bottleneck heuristics: the catalogue,
and the rules, verdicts, diagnose and dashboards made from it."""
