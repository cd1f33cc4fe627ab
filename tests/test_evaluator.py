"""The PromQL evaluator answers as Prometheus does, on every query diagnose and the alerts send.

Every promtool case and seed scenario of tests/rule_cases.py (as test_agreement.py loads them)
is backfilled into one real Prometheus and loaded into an evaluator's store. At each case's
evaluation time, every query ``diagnose`` sends (its readings, recording rules written inline,
over the raw series and over the recorded ones) and every alert's condition is asked of both;
the answers must be the same label sets with the same values. So is diagnose's whole document.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest
from conftest import ROOT, require_binary
from gpu.replay import Backfilled, inline_alerts
from test_agreement import BASE, CASES, duration, openmetrics

from exporter.heuristics import diagnose
from exporter.heuristics.evaluator import Engine, QueryError, Store, labels_of
from exporter.heuristics.rules import identity, settings

_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)\{(.*)\} (\S+) (\d+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
TIMES = sorted({BASE + duration(t) for c in CASES for t in (c.fire_at, c.quiet_at) if t})


def store_of(text: str) -> Store:
    """The OpenMetrics backfill's samples, in a store (no staleness: a backfill has none)."""
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            name, labels, value, t = m.groups()
            rows.append((int(t) * 1000, labels_of({**dict(_LABEL.findall(labels)),
                                                   "__name__": name}), float(value)))
    store = Store(retention_ms=10 ** 12)
    for t, labels, value in sorted(rows):
        store.append(labels, t, value)
    return store


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    require_binary("promtool")
    require_binary("prometheus")
    text = openmetrics(CASES)
    prom = Backfilled(text, tmp_path_factory.mktemp("evaluator"))
    yield prom, store_of(text)
    prom.stop()


def answers(result: list[tuple[dict[str, str], float]]) -> dict[tuple, float]:
    return {labels_of(labels): value for labels, value in result}


def same(a: dict[tuple, float], b: dict[tuple, float]) -> bool:
    return a.keys() == b.keys() and all(
        math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) or a[k] == b[k] for k in a)


class Recording(diagnose.Prometheus):
    """diagnose's client, noting every query it sends and Prometheus' answer."""

    def __init__(self, url: str, at: str) -> None:
        super().__init__(url, at=at)
        self.answered: dict[str, dict[tuple, float]] = {}

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        result = super().query(expr)
        self.answered[expr] = answers(result)
        return result


def test_every_query_diagnose_and_the_alerts_send_is_answered_as_prometheus_does(both):
    prom, store = both
    cfg = settings()
    alerts = [a["inlined"] for a in inline_alerts(
        (ROOT / "alerts" / "gputrain.rules.yml").read_text())]
    differ, asked, elapsed = [], 0, 0.0
    for t in TIMES:
        client = Recording(prom.url, at=str(t))
        diagnose.collect(client, cfg["selector"], "5m", None, identity(cfg))
        for expr in alerts:
            client.query(expr)
        engine = Engine(store, t * 1000)
        for expr, truth in client.answered.items():
            started = time.perf_counter()
            ours = answers(engine.query(expr))
            elapsed += time.perf_counter() - started
            asked += 1
            if not same(truth, ours):
                differ.append((t - BASE, expr, truth, ours))
    print(f"{asked} queries at {len(TIMES)} times, the evaluator's CPU: {elapsed:.1f} s")
    assert asked > 200
    assert not differ, "\n\n".join(
        f"at +{t}s: {expr}\nPrometheus: {truth}\nevaluator:  {ours}"
        for t, expr, truth, ours in differ[:5]) + f"\n({len(differ)} differ)"


def test_diagnose_over_the_evaluator_writes_the_document_it_writes_over_prometheus(both):
    prom, store = both
    cfg = settings()
    for t in TIMES[::3]:
        over_prometheus = diagnose.collect(diagnose.Prometheus(prom.url, at=str(t)),
                                           cfg["selector"], "5m", None, identity(cfg))
        over_store = diagnose.collect(Engine(store, t * 1000), cfg["selector"], "5m", None,
                                      identity(cfg))
        a = json.loads(json.dumps(diagnose.json_document(*over_prometheus)))
        b = json.loads(json.dumps(diagnose.json_document(*over_store)))
        assert len(a["ranks"]) > 10
        assert _approx_equal(a, b), t - BASE


def _approx_equal(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_approx_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_approx_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# --- what it refuses, and the corners of the language, beside a real Prometheus -------------

def test_what_it_does_not_evaluate_is_an_error_naming_it():
    engine = Engine(Store(), 0)
    with pytest.raises(QueryError, match="predict_linear"):
        engine.query("predict_linear(x[5m], 60)")
    with pytest.raises(QueryError, match="cannot parse"):
        engine.query("sum by (")
    with pytest.raises(QueryError, match="stddev"):
        engine.query("stddev(x)")


CORNERS = [
    # a counter that resets, extrapolated to the window's edges
    'rate(gputrain_training_steps_total[5m])',
    'increase(gputrain_training_steps_total[10m] offset 2m)',
    # a subquery of the default resolution, and of its own
    'max_over_time((rate(gputrain_training_steps_total[2m]))[10m:])',
    'avg_over_time((rate(gputrain_training_steps_total[2m]))[10m:30s])',
    # matching: many-to-one with a label copied from the one side; ignoring; set operations
    'gputrain_gpu_power_watts * on (job, instance) group_left (node) label_replace(count by '
    '(job, instance) (gputrain_gpu_power_watts), "node", "n-$1", "instance", "([^:]*).*")',
    'count by (job, instance) (gputrain_gpu_power_watts) / on (job, instance) group_right '
    'gputrain_gpu_power_watts',
    'sum by (job, run) (gputrain_training_steps_total) > bool ignoring (run) '
    'group_left sum by (job) (gputrain_training_steps_total) / 4',
    'gputrain_training_steps_total unless on (job) gputrain_gpu_power_watts > 300',
    'label_replace(gputrain_training_steps_total, "r", "rank-$1", "rank", "(.*)")',
    'timestamp(gputrain_training_steps_total)',
    'histogram_quantile(0.9, sum by (job, run, rank, le) '
    '(rate(gputrain_training_step_duration_seconds_bucket[5m])))',
    'quantile by (job) (0.3, gputrain_gpu_power_watts)',
    'count without (gpu, uuid) (gputrain_gpu_power_watts)',
    'clamp(gputrain_gpu_power_watts / 100, 0.5, 2)',
    '-gputrain_gpu_power_watts % 7 ^ 2',
    '1 / (gputrain_gpu_power_watts - gputrain_gpu_power_watts)',
]


@pytest.mark.parametrize("expr", CORNERS)
def test_the_corners_of_the_language_are_answered_as_prometheus_does(both, expr):
    prom, store = both
    held = 0
    for t in TIMES[::4]:
        truth = answers(diagnose.Prometheus(prom.url, at=str(t)).query(expr))
        ours = answers(Engine(store, t * 1000).query(expr))
        held += len(truth)
        assert same(truth, ours), (expr, t - BASE, truth, ours)
    assert held, f"{expr} holds nothing at any time: no corner tested"


def test_a_match_prometheus_refuses_is_refused(both):
    prom, store = both
    expr = ("gputrain_training_steps_total * on (job, instance) group_left (uuid) "
            "max by (job, instance, uuid) (gputrain_gpu_power_watts)")
    refused = 0
    for t in TIMES:
        try:
            truth = answers(diagnose.Prometheus(prom.url, at=str(t)).query(expr))
        except diagnose.PrometheusError as exc:
            assert "many-to-many" in str(exc)
            refused += 1
            with pytest.raises(QueryError, match="many-to-many"):
                Engine(store, t * 1000).query(expr)
        else:  # where the right side happens to be unique, both answer
            assert same(truth, answers(Engine(store, t * 1000).query(expr)))
    assert refused
