"""A rank's reading over a window is written once, as a tree (exporter/heuristics/expr.py): its
recording rule is the tree rendered, and the daemon's history evaluates the tree over its own
points. Here a scripted rank pushes to a real ingest; the history reads it, and the rank's
/metrics lines, scraped every push into the PromQL evaluator (which tests/test_agreement.py
holds to a real Prometheus), answer each reading's generated rule: the two agree on every tree
reading, across a restart of the rank's process (a counter reset), and a throwaway reading
added to a copy of the package in its row alone is recorded by the rules and read by the
daemon."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, edited_package
from prometheus_client.parser import text_string_to_metric_families

from exporter.heuristics.evaluator import Engine, Store, labels_of
from exporter.heuristics.expr import (
    Aggregate,
    Binary,
    Gauge,
    Number,
    Point,
    Quantile,
    Series,
    compiled,
)
from exporter.heuristics.promql import Identity, _fragments
from exporter.heuristics.readings import BY_FIELD, of_scope, window_seconds
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.collectors import host_collectors
from exporter.reading.collectors.cpu import CpuReading
from exporter.reading.collectors.disk import DiskReading
from exporter.reading.collectors.memory import MemoryReading
from exporter.reading.collectors.network import NetworkReading
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import GAUGE_READINGS, INSTANT, WINDOWED, History
from exporter.serving.ingest import IngestStore
from exporter.serving.training import COUNTERS, TrainingCollector

SELECTOR = 'job="gputrain"'
BOUNDS = [0.05, 0.1, 0.25, 0.5, 1.0]
EVERY = 5.0  # seconds between pushes (and scrapes)


def _push(store: IngestStore, run_id: str, k: int, wall: float, *without: str) -> None:
    """The ``k``-th push of a process: 10 steps of 0.2 s (every tenth 2 s: a slow step), a
    quarter of each waiting for data, a checkpoint phase, communication, FLOPs and CPU (but
    the fields ``without``)."""
    steps = 10 * k
    slow = k
    step_seconds = 0.2 * (steps - slow) + 2.0 * slow
    body = {
        "version": SCHEMA_VERSION, "run": "r", "rank": "0", "run_id": run_id,
        "steps": steps, "step_seconds": step_seconds, "data_wait_seconds": step_seconds / 4,
        "samples": 32.0 * steps, "elapsed_seconds": wall, "flops": 1e12 * steps,
        "comm_seconds": 0.05 * steps, "comm_exposed_seconds": 0.01 * steps,
        "step_buckets": BOUNDS, "step_counts": [0, 0, steps - slow, steps - slow, steps - slow],
        "phases": {"checkpoint": 0.5 * k, "forward": 0.05 * steps},
        "process": {"cpu_seconds": 3.0 * k, "cpu_throttled_seconds": 0.5 * k,
                    "cpu_allowance_cores": 4.0}}
    store.push(json.dumps({k: v for k, v in body.items() if k not in without}).encode())


def _scrape(collector: TrainingCollector, store: Store, t: float) -> None:
    """The rank's page lines as Prometheus would scrape them at ``t``, job and instance
    added."""
    samples = []
    for family in text_string_to_metric_families(collector.render().decode()):
        for s in family.samples:
            samples.append((labels_of({**s.labels, "__name__": s.name, "job": "gputrain",
                                       "instance": "n1"}), s.value))
    store.append_all(int(t * 1000), samples)


@pytest.fixture(scope="module")
def watched() -> tuple[dict, Engine]:
    """Eight minutes of one rank, its process restarted at minute 6 (its counters from 0,
    its wall time going on; its first two pushes without its communication: a client sends it
    once it has some): the history's report and the evaluator at the end."""
    now = [1_000_000.0]
    ingest = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(instance="n1", clock=lambda: now[0])
    views = Attribution()
    view = [views.update(Snapshot(0, now[0], "test", ""), ingest.states())]
    collector = TrainingCollector(ingest, lambda: view[0])
    scraped = Store()
    for k in range(1, 97):
        now[0] += EVERY
        if k <= 72:
            _push(ingest, "first", k, EVERY * k)
        else:  # a new process: its counters count from 0 again
            _push(ingest, "second", k - 72, EVERY * k,
                  *(("comm_seconds", "comm_exposed_seconds") if k < 75 else ()))
        view[0] = views.update(Snapshot(k, now[0], "test", ""), ingest.states())
        history.observe(view[0])
        _scrape(collector, scraped, now[0])
    (rep,) = history.reports()
    return vars(rep), Engine(scraped, int(now[0] * 1000))


def _rule(field: str) -> str:
    reading = BY_FIELD[field]
    w = "5m" if reading.window == "rate" else "30m" if reading.window == "quantile" else ""
    return reading.template.format(**_fragments(SELECTOR, Identity(), w))


def test_every_node_reading_the_history_computes_is_a_tree():
    assert {r.field for r in of_scope("node") if r.tree is not None} == {
        "cpu_busy", "iowait", "memory_available", "swap_rate", "disk_busy", "network_rx_used",
        "network_duplex_used"}


CHECKED = [r.field for r in (*WINDOWED, *INSTANT) if r.field != "mfu"]  # mfu: a GPU's peak


def test_every_windowed_rank_reading_the_history_computes_is_a_tree():
    """What the history reads of a rank over a window is the trees' (no arithmetic of its own
    for these): the ratios of counters, the percentiles, the plain rates."""
    assert {r.field for r in WINDOWED} >= {
        "data_wait_ratio", "samples_per_second", "step_seconds", "comm_ratio",
        "comm_exposed_ratio", "step_p50_seconds", "step_p99_seconds", "stall_share",
        "slow_step_ratio", "slow_step_wait", "phases", "cpu_allowance_used", "cpu_throttled",
        "steps_per_second", "mfu"}
    assert all(r.scope == "rank" for r in WINDOWED)
    # a tree rates counters only, as rate() is only right of them (their resets are carried)
    assert all(r.tree.names() <= COUNTERS for r in WINDOWED if r.tree), \
        [r.field for r in WINDOWED if r.tree and not r.tree.names() <= COUNTERS]
    # the rest of a rank's trees are its gauges read as they are (history.read_gauges; the
    # step in progress by the daemon's own clock)
    assert {r.field for r in of_scope("rank") if r.tree is not None} == \
        {r.field for r in (*WINDOWED, *INSTANT)} | {r.field for r, _ in GAUGE_READINGS} | \
        {"step_in_progress"}


@pytest.mark.parametrize("field", CHECKED)
def test_the_history_and_the_generated_rule_agree(watched, field):
    report, engine = watched
    reading = BY_FIELD[field]
    answer = engine.query(_rule(field))
    ours = report[field]
    if reading.by is not None:
        theirs = {labels[reading.by]: v for labels, v in answer}
        assert set(ours) == set(theirs) and ours, (ours, theirs)
        for k, v in theirs.items():
            assert ours[k] == pytest.approx(v, rel=1e-9), (k, ours, theirs)
        return
    assert len(answer) == 1, answer
    theirs = answer[0][1]
    if not math.isfinite(theirs):  # x/0: diagnose reads no reading, as the history
        assert ours is None, (ours, theirs)
        return
    assert ours is not None, f"the rule reads {theirs}, the history nothing"
    # the pace is steady, so the windows' edges (a point older, an extrapolation) weigh nothing
    assert ours == pytest.approx(theirs, rel=1e-9), (ours, theirs)


def test_the_restart_is_read_as_rate_reads_a_reset(watched):
    """Over a window with the reset in it, the rate of steps is the steady one (10 steps a
    push), not negative nor doubled."""
    report, _ = watched
    assert report["steps_per_second"] == pytest.approx(10 / EVERY, rel=0.03)
    assert report["data_wait_ratio"] == pytest.approx(0.25, rel=1e-6)
    assert window_seconds("rate") > 24 * EVERY  # the reset is inside the window


# --- a node's readings: the host's page lines, scraped, against the history's trees ---------

def _host(k: int) -> dict:
    """The host's readings at the ``k``-th cycle (5 s apart): 8 CPUs 50 % user, 10 % iowait
    (busy is neither idle nor iowait: 50 %); two disks, one 30 % busy; two interfaces, one
    receiving 40 % of its 1 GB/s link and sending 55 %, one without a known speed, and one
    that comes up in the last two minutes with a large total since boot (its rate is over its
    own samples, 10 %); swapping 1 MB/s; memory available falling."""
    t = EVERY * k
    return {
        "cpu": CpuReading({"user": 8 * t * 0.5, "iowait": 8 * t * 0.1, "idle": 8 * t * 0.4}, 8),
        "memory": MemoryReading(64e9, 32e9 - 1e6 * k, 4e5 * t, 6e5 * t),
        "disk": {"sda": DiskReading(1e6 * t, 2e6 * t, 0.3 * t),
                 "sdb": DiskReading(1e5 * t, 0.0, 0.05 * t)},
        "network": {"eth0": NetworkReading(0.4e9 * t, 0.55e9 * t, 1e9),
                    "eth1": NetworkReading(1e8 * t, 1e8 * t, None),
                    **({"eth2": NetworkReading(5e12 + 1e8 * t, 5e12 + 1e8 * t, 1e9)}
                       if k > 96 else {})},
    }


@pytest.fixture(scope="module")
def node_watched() -> tuple[dict, Engine]:
    """Ten minutes of the host: the history's node readings and the evaluator at the end."""
    collectors = host_collectors()
    history = History(instance="n1", collectors=collectors)
    scraped = Store()
    t0 = 1_000_000.0
    for k in range(1, 121):
        snap = Snapshot(k, t0 + EVERY * k, "test", "", (), _host(k))
        history.observe(Attribution().update(snap, []))
        samples = [(labels_of({**s.labels, "__name__": s.name, "job": "gputrain",
                               "instance": "n1"}), s.value)
                   for c in collectors for family in c.render(snap.host[c.name])
                   for s in family.samples]
        scraped.append_all(int(snap.timestamp * 1000), samples)
    return history.host_readings(), Engine(scraped, int((t0 + EVERY * 120) * 1000))


@pytest.mark.parametrize("field", [r.field for r in of_scope("node") if r.tree is not None])
def test_the_history_and_the_generated_rule_agree_on_the_node(node_watched, field):
    readings, engine = node_watched
    (answer,) = engine.query(_rule(field))
    assert readings.get(field) == pytest.approx(answer[1], rel=1e-9), (readings, answer)


def test_the_node_readings_are_what_the_host_did(node_watched):
    readings, _ = node_watched
    assert readings["cpu_busy"] == pytest.approx(0.5)
    assert readings["iowait"] == pytest.approx(0.1)
    assert readings["disk_busy"] == pytest.approx(0.3)
    assert readings["network_rx_used"] == pytest.approx(0.4)
    assert readings["network_duplex_used"] == pytest.approx(0.4)  # the lesser direction
    assert readings["swap_rate"] == pytest.approx(1e6)
    assert readings["memory_available"] == pytest.approx(32e9 - 1.2e8)


# a throwaway reading: its row and its report field, in a copy of the package
EDITS = [
    ("heuristics/readings.py", "    Reading(\"finished\", \"rank\",",
     "    Reading(\"throwaway\", \"rank\", \"run_rank:gputrain_training_throwaway:rate5m\",\n"
     "            \"rate\", SAMPLES / STEPS),\n"),
    ("heuristics/readings.py", "    stopped: bool = False\n",
     "    throwaway: float | None = None\n"),
]


@pytest.mark.parametrize("where, anchor, text", EDITS)
def test_edits(where, anchor, text):
    """(The edits the next test makes: each anchor is in its file once.)"""
    assert (ROOT / "exporter" / where).read_text().count(anchor) == 1


def test_a_new_windowed_reading_takes_its_row_and_its_field_and_nothing_else(tmp_path):
    edited_package(tmp_path, EDITS)
    probe = f"""
import json
from exporter.heuristics.rules import render
from exporter.reading.collectors import host_collectors
from exporter.reading.collectors.cpu import CpuReading
from exporter.reading.collectors.disk import DiskReading
from exporter.reading.collectors.memory import MemoryReading
from exporter.reading.collectors.network import NetworkReading
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
rules = render()
assert "record: run_rank:gputrain_training_throwaway:rate5m" in rules, "no recording rule"
assert "(rate(gputrain_training_samples_total" in rules.split("throwaway:rate5m")[1]
now = [1e6]
ingest = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
history, views = History(instance="n1", clock=lambda: now[0]), Attribution()
for k in range(1, 40):
    now[0] += 5
    ingest.push(json.dumps({{"version": {SCHEMA_VERSION}, "run": "r", "rank": "0",
                            "run_id": "a", "steps": 3 * k, "step_seconds": 1.5 * k,
                            "data_wait_seconds": 0.0, "samples": 96.0 * k}}).encode())
    history.observe(views.update(Snapshot(k, now[0], "test", ""), ingest.states()))
(rep,) = history.reports()
print(rep.throwaway)
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(32.0)


# --- the trees' own language: what PromQL does, or an error at import ------------------------

def _points(old: dict, now: dict) -> tuple[Point, Point]:
    names = {n: i for i, n in enumerate(sorted({*old, *now}))}
    return (Point(0.0, old, tuple(old.get(n) for n in names), names),
            Point(10.0, now, tuple(now.get(n) for n in names), names))


C = Series("c", "x", rate=False)  # a node's gauge c, one series by its label x


@pytest.mark.parametrize("tree, expected", [
    # a comparison filters, keeping the compared value (not a bool), on either side
    (Gauge("a") < Gauge("b"), 1.0),
    (Gauge("b") < Gauge("a"), None),
    (Number(15) < C, {"y": 20.0}),
    (Binary(">", C, Number(15)), {"y": 20.0}),
    # x/0 is no reading; or fills in what its left side lacks
    (Gauge("a") / Number(0), None),
    (Binary(">", C, Number(15)).or_(C), {"x": 1.0, "y": 20.0}),
    (Aggregate("max", C), 20.0),
    (Aggregate("sum", Series("c", "x", rate=False, matcher='x=~"y|z"')), 20.0),
])
def test_a_tree_evaluates_as_promql_reads_it(tree, expected):
    old, now = _points({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0})
    now = now._replace(gauges={"a": 1.0, "b": 2.0, "c": {"x": 1.0, "y": 20.0}})
    (value,) = compiled([tree], now.names)(old, now, {}, None)
    assert value == expected


def test_a_tree_promql_would_read_otherwise_is_refused():
    with pytest.raises(ValueError, match="aggregation"):
        Aggregate("avg", C)
    with pytest.raises(ValueError, match="operator"):
        Binary("and", Gauge("a"), Gauge("b"))
    # a node's series against one number of the node: PromQL matches them one to one (none)
    with pytest.raises(ValueError, match="aggregate them first"):
        C / Aggregate("sum", C)
    with pytest.raises(ValueError, match="no matcher of the label"):
        compiled([Series("c", "x", matcher='y="1"')], {})
    assert Number(1).template() == "1" and Quantile(0.9999, "h").template().startswith(
        "histogram_quantile(0.9999,")
