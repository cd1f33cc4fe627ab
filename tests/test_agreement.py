"""diagnose and the alerts cannot disagree, nor the PromQL evaluator and Prometheus.

Every promtool case and seed scenario of tests/rule_cases.py (their expected alerts are checked
by promtool in test_rules.py), plus cases on the thresholds' boundaries, is backfilled into one
real Prometheus, each case under a job of its own. `gputrain-exporter diagnose --json --time`
at the case's evaluation time must then name, for every rank, exactly the bottleneck alerts the
case fires (the verdict and its `also:` findings), `underutilized` where only
GpuTrainGPUUnderutilized fires, and `ok` only where nothing fires. The alerts are every rule's
condition, recording rules inlined, at the same time in the same Prometheus, diagnose and the
rules both scoped by the scrape-job selector to the cases judged at that time; that the shipped
rules match each case's promtool expectations is test_rules.py's job.

Every query Prometheus answered there is then asked of the PromQL evaluator
(exporter/heuristics/evaluator.py) over the same samples: the same label sets and values.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import re
import time
from collections.abc import Iterator
from dataclasses import asdict

import pytest
import rule_cases
from conftest import require_binary
from gpu.replay import Backfilled, inline_groups, openmetrics_text

from exporter.heuristics.catalogue import BY_ALERT, BY_VERDICT
from exporter.heuristics.diagnose import Prometheus, PrometheusError, diagnose, json_document
from exporter.heuristics.evaluator import Engine, QueryError, Store, labels_of
from exporter.heuristics.readings import READINGS
from exporter.heuristics.rules import DEFAULTS
from exporter.heuristics.rules import groups as rule_groups
from exporter.heuristics.verdict import NOTES, STATUS, STATUS_OF, RankReport, judge, visibility
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.collectors.cpu import CpuReading
from exporter.reading.collectors.disk import DiskReading
from exporter.reading.collectors.network import NetworkReading
from exporter.reading.gpu_backends import GpuIdentity, GpuSample
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore

BASE = 1_700_000_000  # the backfilled series start here (unix seconds)
# the exporter's wall-clock times (the ages beside them are not shifted)
SHIFTED = (*rule_cases.AGED, "gputrain_exporter_time_seconds")
_SERIES = re.compile(r'^([a-zA-Z_:][\w:]*)\{(.*)\}$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
def duration(text: str) -> int:
    """'45m' -> 2700 (seconds)."""
    return int(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def job_of(i: int) -> str:
    return f"gputrain-case{i}"


def samples(cases: list[rule_cases.Case]) -> Iterator[tuple[str, dict[str, str], float, int]]:
    """Every case's samples, under its own job: (name, labels, value, unix seconds)."""
    for i, case in enumerate(cases):
        interval = duration(case.interval)
        for selector, values in case.series.items():
            name, labels = _SERIES.match(selector).groups()
            pairs = {**dict(_LABEL.findall(labels)), "job": job_of(i)}
            # a time moves with the series (a collector's last success, a rank's last push):
            # the cases count from 0, the backfill from BASE (its age is the time less it)
            shift = BASE if name in SHIFTED else 0
            for k, v in enumerate(rule_cases.expand(values)):
                if v is not None:
                    yield name, pairs, v + shift, BASE + k * interval


def openmetrics(cases: list[rule_cases.Case]) -> str:
    """Every case's series, under its own job, as OpenMetrics with timestamps."""
    by_name: dict[str, list[str]] = {}
    for name, pairs, v, t in samples(cases):
        text = ",".join(f'{k}="{x}"' for k, x in sorted(pairs.items()))
        by_name.setdefault(name, []).append(f"{name}{{{text}}} {v!r} {t}")
    return openmetrics_text(by_name)


def boundary_cases() -> list[rule_cases.Case]:
    """Runs just either side of the lines where diagnose and the alerts used to part: GPU busy
    80-90 %, data wait 4-6 %, power just under and over the launch-bound line. Their
    expectations are in BOUNDARY."""
    signals = dict(samples_per_s=100, step_s=0.1, mem_gb=8, cpu_busy=0.3)
    runs = {"busy85-power30": (0.85, 0.01, 90), "busy85-power41": (0.85, 0.01, 123),
            "busy81-power39": (0.81, 0.01, 117), "busy79-power30": (0.79, 0.01, 90),
            "busy91-power39": (0.91, 0.01, 117), "wait4": (0.95, 0.04, 250),
            "wait6": (0.95, 0.06, 250)}
    return [rule_cases.Case(f"boundary {run}", rule_cases.training_run(
                run, busy=busy, wait=wait, power_w=power, **signals), [], fire_at="45m",
                signals={"run": run, "busy": busy, "wait": wait, "power_w": power, **signals})
            for run, (busy, wait, power) in runs.items()]


def sampled_cases(n: int = 16, seed: int = 48) -> list[rule_cases.Case]:
    """Runs drawn at random (seeded) over the whole space of a rank's signals, not only where
    a case study or a threshold put them: the daemon's page, diagnose and the alerts must
    conclude the same of each (what fires is whatever the alerts say; the tests compare)."""
    rnd = random.Random(seed)
    out = []
    for k in range(n):
        step_s = rnd.choice((0.02, 0.08, 0.3, 1.2))
        gpm = rnd.random() < 0.6  # SM and tensor activity where the GPU has GPM
        signals: dict = dict(
            busy=round(rnd.uniform(0.2, 1.0), 3), wait=round(rnd.uniform(0.0, 0.7), 3),
            samples_per_s=round(rnd.uniform(20, 4000)), step_s=step_s,
            mem_gb=round(rnd.uniform(0.5, 15.9), 2), power_w=round(rnd.uniform(40, 300)),
            cpu_busy=round(rnd.uniform(0.05, 0.98), 3),
            pcie_rx=round(rnd.uniform(0.0, 0.6), 3), net_rx=round(rnd.uniform(0.0, 0.95), 3),
            sm=round(rnd.uniform(0.1, 0.9), 3) if gpm else None,
            tensor=round(rnd.uniform(0.0, 0.5), 3) if gpm else None,
            phases={"checkpoint": round(rnd.uniform(0.0, 0.3), 3)} if rnd.random() < 0.3
            else None)
        run = f"sampled{k}"
        out.append(rule_cases.Case(f"sampled {run}: {signals}",
                                   rule_cases.training_run(run, **signals), [], fire_at="45m",
                                   quiet_at=None, signals={"run": run, **signals}))
    return out


# run -> (the findings, whether GpuTrainGPUUnderutilized fires)
BOUNDARY = {"busy85-power30": ({"launch-bound"}, True), "busy85-power41": (set(), True),
            "busy81-power39": ({"launch-bound"}, True), "busy79-power30": (set(), True),
            "busy91-power39": ({"launch-bound"}, False), "wait4": (set(), False),
            "wait6": ({"input-bound"}, False)}


CASES = rule_cases.alert_cases() + rule_cases.seed_cases() + boundary_cases() + sampled_cases()


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory):
    require_binary("promtool")
    require_binary("prometheus")
    prom = Backfilled(openmetrics(CASES), tmp_path_factory.mktemp("agreement"))
    yield prom
    prom.stop()


# diagnose --json's nodes, by job and evaluation time (filled by `results`)
NODES: dict[str, list[dict]] = {}

# every query Prometheus answered for `results`, by evaluation time (unix seconds): the
# evaluator is held to them (test_the_evaluator_answers_every_query_as_prometheus_did)
ANSWERED: dict[int, dict[str, dict[tuple, float]]] = {}


def answers(result: list[tuple[dict[str, str], float]]) -> dict[tuple, float]:
    return {labels_of(labels): value for labels, value in result}


@pytest.fixture(scope="module")
def results(backfilled):
    """By job and evaluation time: diagnose --json's reports, and every alert rule's condition
    (recording rules written inline) with the label sets it holds for."""
    out: dict[str, tuple[list[dict], list[tuple[str, dict]]]] = {}
    asked = Prometheus.query

    def noted(self: Prometheus, expr: str) -> list[tuple[dict[str, str], float]]:
        result = asked(self, expr)
        ANSWERED.setdefault(int(str(self.at)), {})[expr] = answers(result)
        return result

    for at in sorted({t for c in CASES for t in (c.fire_at, c.quiet_at) if t}):
        t = BASE + duration(at)
        # the shipped rules and diagnose, both scoped by the scrape-job selector (the setting
        # users scope them with) to the cases judged at this time: every query reads their
        # series alone, not every case's (Prometheus' time for the alerts' queries, 54 s of
        # CPU over the whole backfill, was most of this test's)
        jobs = "|".join(job_of(i) for i, c in enumerate(CASES) if at in (c.fire_at, c.quiet_at))
        scoped = {"selector": f'job=~"{jobs}"'}
        # diagnose in this process (what `diagnose --json --time T` prints; test_diagnose runs
        # the command): a process per evaluation time only added its start
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Prometheus, "query", noted)
            found = diagnose(backfilled.url, overrides=scoped, at=str(t))
            doc = json.loads(json.dumps(json_document(*found)))
        for rep in doc["ranks"]:
            out.setdefault(f"{rep['job']}@{at}", ([], []))[0].append(rep)
        for node in doc["nodes"]:
            NODES.setdefault(f"{node['job']}@{at}", []).append(node)
        for alert in inline_groups(rule_groups(scoped)):
            found = backfilled.query(alert["inlined"], t)
            ANSWERED[t][alert["inlined"]] = {labels_of(x["metric"]): float(x["value"][1])
                                             for x in found if x["value"][1] != "NaN"}
            for series in found:
                labels = series["metric"]
                # a run's alert spans jobs (a run's ranks may be scraped under several): it
                # goes to every case, whose ranks it names by their (unique) run
                for job in [labels["job"]] if "job" in labels else map(job_of, range(len(CASES))):
                    out.setdefault(f"{job}@{at}", ([], []))[1].append((alert["alert"], labels))
    return out


def alerts_for(rep: dict, conditions: list[tuple[str, dict]]) -> tuple[set[str], bool]:
    """The catalogue verdicts of the alerts whose condition holds for this rank (its own, its
    GPUs' and its node's), and whether GpuTrainGPUUnderutilized's does."""
    gpus = {(g["gpu"], g["uuid"]) for g in rep["gpus"]}
    verdicts, underused = set(), False
    for alert, labels in conditions:
        entry = BY_ALERT[alert]
        if "rank" in labels:
            if (labels["run"], labels["rank"]) != (rep["run"], rep["rank"]) or \
                    labels.get("instance", rep["instance"]) != rep["instance"]:
                continue  # (two jobs may push one (run, rank) from two nodes)
        elif "run" in labels and "gpu" not in labels:  # a run's own: for each of its ranks
            if labels["run"] != rep["run"]:
                continue
        elif "run" in labels:  # a run's share of a GPU: for the run's ranks on that GPU
            if labels["run"] != rep["run"] or (labels["gpu"], labels["uuid"]) not in gpus:
                continue
        elif entry.scope == "node":
            if (labels.get("job"), labels.get("instance")) != (rep["job"], rep["instance"]):
                continue
        elif (labels.get("gpu"), labels.get("uuid")) not in gpus:
            continue  # a node's alert about a GPU this rank does not use
        if entry.kind != "symptom":
            verdicts.add(entry.verdict)
        underused |= alert == "GpuTrainGPUUnderutilized"
    return verdicts, underused


# each case where its alerts must fire, and where they must not yet
CHECKS = [(i, at) for i, c in enumerate(CASES) for at in (c.fire_at, c.quiet_at) if at]


@pytest.mark.parametrize("i, at", CHECKS, ids=[f"{CASES[i].name[:64]} @{at}" for i, at in CHECKS])
def test_diagnose_names_exactly_the_alerts_that_fire(results, i, at):
    case = CASES[i]
    reports, conditions = results.get(f"{job_of(i)}@{at}", ([], []))
    if at == case.fire_at:
        fired = {(f.labels["run"], f.labels["rank"]) for f in case.fires if "rank" in f.labels}
        assert fired <= {(r["run"], r["rank"]) for r in reports}, \
            f"diagnose did not see every rank an alert fires for: {sorted(fired)}"
    for rep in reports:
        want, underused = alerts_for(rep, conditions)
        if rep["run"] in BOUNDARY and at == case.fire_at:
            assert (want, underused) == BOUNDARY[rep["run"]], "the boundary case moved"
        got = set(rep["findings"])
        who = f"run {rep['run']} rank {rep['rank']}"
        assert got == want, (f"{who}: diagnose says {sorted(got)} ({rep['reason']}), the "
                             f"alerts {sorted(want)}")
        if want - set(NOTES):
            assert rep["status"] == (STATUS_OF.get(rep["verdict"])
                                     or STATUS[BY_VERDICT[rep["verdict"]].kind])
        elif underused:
            assert rep["status"] == "underutilized", f"{who}: {rep['status']}"
        else:
            assert rep["status"] in ("ok", "no-gpu-data", "finished"), f"{who}: {rep['status']}"
            # (waiting: for a peer's declared phase, which no alert is)
            assert rep["verdict"] in ("gpu-bound", "paused", "no-gpu-data", "finished",
                                      "restarted", "waiting")


@pytest.mark.parametrize("i, at", CHECKS, ids=[f"{CASES[i].name[:64]} @{at}" for i, at in CHECKS])
def test_diagnose_finds_on_each_node_and_gpu_exactly_the_alerts_that_fire(results, i, at):
    """What diagnose says of every node and every GPU of it, whoever uses them (a GPU no rank
    names, a node no run is on, are judged too), is the node and GPU alerts that fire for
    them: none missing, none extra."""
    _, conditions = results.get(f"{job_of(i)}@{at}", ([], []))
    want = {(labels.get("instance"), labels.get("gpu", ""), BY_ALERT[alert].verdict)
            for alert, labels in conditions
            if BY_ALERT[alert].scope in ("gpu", "node") and "rank" not in labels
            and "run" not in labels}
    got = {(node["instance"], f["gpu"], f["name"])
           for node in NODES.get(f"{job_of(i)}@{at}", []) for f in node["findings"]}
    assert got == want, f"diagnose's findings {sorted(got)}, the alerts {sorted(want)}"


# --- the daemon's own verdict (/, /api/v1/status, top) on the same seed scenarios --------------

def local_report(signals: dict) -> RankReport:
    """A seed scenario lived by the daemon: six minutes of snapshots (its GPU, CPUs, disk and
    NIC at the scenario's ratios) and of the rank's pushes through the ingest, every 5 s, then
    judged from the daemon's history by the verdict code diagnose runs."""
    s = {name: p.default for name, p in inspect.signature(rule_cases.training_run).parameters
         .items() if p.default is not inspect.Parameter.empty} | signals
    link, speed, cores = 15.75e9, 1.25e9, 8  # as training_run's series
    now = [float(BASE)]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(window=300.0, point_seconds=5.0, instance="n1:19400")
    views = Attribution()
    idle = 1 - s["cpu_busy"]
    for k in range(73):
        t = 5.0 * k
        now[0] = BASE + t
        store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": s["run"], "rank": "0", "run_id": "a1",
            "steps": int(t / s["step_s"]), "step_seconds": t, "data_wait_seconds": s["wait"] * t,
            "samples": s["samples_per_s"] * t, "elapsed_seconds": t,
            "last_step_timestamp": now[0], "gpus": ["0"],
            "phases": {p: r * t for p, r in (s["phases"] or {}).items()}}).encode())
        sample = GpuSample(now[0], utilization=s["busy"], sm_active=s["sm"],
                           tensor_active=None if s["sm"] is None else s["tensor"] or 0.0,
                           memory_used_bytes=s["mem_gb"] * 1e9,
                           memory_total_bytes=s["mem_total_gb"] * 1e9,
                           power_watts=s["power_w"], power_limit_watts=s["power_limit_w"],
                           pcie_link_max_bytes_per_second=link)
        gpu = GpuState(GpuIdentity("0", "GPU-0"), up=True, sample=sample, sampled_seconds=t,
                       busy_seconds=s["busy"] * t, pcie_rx_bytes=s["pcie_rx"] * link * t,
                       pcie_tx_bytes=0.0)
        host = {"cpu": CpuReading({"user": cores * s["cpu_busy"] * t, "idle": cores * idle * t,
                                   "iowait": 0.0}, cores),
                "disk": {"nvme0n1": DiskReading(0.0, 0.0, 3 / 60 * t)},
                "network": {"eth0": NetworkReading(s["net_rx"] * speed * t, 0.0, speed)}}
        history.observe(views.update(Snapshot(k, now[0], "test", "", (gpu,), host), store.states()))
    (rep,) = judge(visibility(history.reports()), DEFAULTS["thresholds"])
    return rep


SEEDS = [(i, c) for i, c in enumerate(CASES) if c.signals is not None]


@pytest.mark.parametrize("i, case", SEEDS, ids=[c.name[:70] for _, c in SEEDS])
def test_the_daemon_judges_each_seed_scenario_as_diagnose_does(results, i, case):
    (remote,) = [r for r in results[f"{job_of(i)}@{case.fire_at}"][0]
                 if r["run"] == case.signals["run"]]
    local = local_report(case.signals)
    assert (local.status, local.verdict, set(local.findings())) == \
        (remote["status"], remote["verdict"], set(remote["findings"])), \
        f"{case.name}: the daemon says {local.verdict} ({local.reason}), diagnose " \
        f"{remote['verdict']} ({remote['reason']})"
    # every reading of the table that Prometheus has of the scenario, the daemon has too, at
    # the same value (one it has no series for here is None there, and not compared)
    mine = asdict(local)
    compared = []
    for name, theirs in table_readings(remote).items():
        if theirs in (None, {}):
            continue
        ours = table_readings(mine)[name]
        assert ours is not None, f"{case.name}: the daemon has no {name} (diagnose {theirs})"
        # the scenario's pushes count whole steps (the series do not): the daemon's step count
        # over its 300 s window is off by under one step
        per_step = name in ("steps_per_second", "step_seconds", "typical_step_seconds")
        rel = remote["step_seconds"] / 300 if per_step else 1e-6
        assert ours == pytest.approx(theirs, rel=rel, abs=1e-9), f"{case.name}: {name}"
        compared.append(name)
    assert {"data_wait_ratio", "samples_per_second", "gpu busy", "node cpu_busy"} <= \
        set(compared)


def table_readings(rep: dict) -> dict[str, object]:
    """A report's readings of readings.READINGS (diagnose --json's, or a RankReport as a
    dict), by name: a GPU's (its first GPU) as ``gpu <field>``, its node's as ``node <key>``."""
    out: dict[str, object] = {}
    for x in READINGS:
        for name in x.names:
            if x.scope == "rank":
                out[name] = rep[name]
            elif x.scope == "node":
                out[f"node {name}"] = rep["host"].get(name)
            else:
                out[f"gpu {name}"] = rep["gpus"][0][name] if rep["gpus"] else None
    return out


def test_every_seed_scenario_is_judged_locally():
    assert len(SEEDS) == len(rule_cases.seed_cases()) + len(boundary_cases()) + \
        len(sampled_cases()) and len(rule_cases.seed_cases()) >= 13


def test_diagnose_judges_a_run_younger_than_the_window_on_its_last_minute(results):
    """Through a real Prometheus: jobs 3 minutes old on GPUs that idled, or served another
    run, before them read their last minute (95 % busy: gpu-bound, where the 5 minutes read
    57 % and 69 %); the near miss, 7 minutes old, is read over the 5 with its GPU's idle
    minute inside them (76 %: underutilized). tests/test_young_runs.py lives the same through
    the daemon."""
    (i,) = [i for i, c in enumerate(CASES)
            if c.name.startswith("A run younger than the rate window")]
    reports = {r["run"]: r for r in results[f"{job_of(i)}@{CASES[i].fire_at}"][0]}
    for run in ("fresh", "after"):
        assert reports[run]["verdict"] == "gpu-bound", reports[run]["reason"]
        assert reports[run]["gpus"][0]["busy"] == pytest.approx(0.95, abs=0.005)
    assert reports["settled"]["verdict"] == "underutilized", reports["settled"]["reason"]
    assert reports["settled"]["gpus"][0]["busy"] == pytest.approx(0.76, abs=0.005)


def test_diagnose_says_whether_the_tree_or_the_node_loses_the_memory(results):
    """Issue 37, principle 4, through a real Prometheus: the rank whose RSS stays flat while
    its node's available memory falls is told the memory goes outside its process tree; the
    rank whose PSS grows is told its tree's PSS grows; the near misses say nothing of a leak."""
    (i,) = [i for i, c in enumerate(CASES)
            if c.name.startswith("GpuTrainHostMemoryLeak: DataLoader workers copy")]
    reports = {r["run"]: r for r in results[f"{job_of(i)}@{CASES[i].fire_at}"][0]}

    def leak(rep: dict) -> str | None:
        found = [{"reason": rep["reason"]}] if rep["verdict"] == "memory-leak" else []
        found += [a for a in rep["also"] if a["name"] == "memory-leak"]
        return found[0]["reason"] if found else None

    assert "beyond what the training processes' memory explains" in leak(reports["cow"])
    assert "2.6 h" in leak(reports["cow"]), leak(reports["cow"])
    assert reports["cow"]["memory_measure"] == "rss"
    assert "proportional (PSS) memory grows 200 MiB/min" in leak(reports["pss"])
    for run in ("loaded", "slow", "shared"):
        assert leak(reports[run]) is None, (run, reports[run]["reason"])


# --- the PromQL evaluator (exporter/heuristics/evaluator.py) answers as Prometheus did --------

TIMES = sorted({BASE + duration(t) for c in CASES for t in (c.fire_at, c.quiet_at) if t})


@pytest.fixture(scope="module")
def store() -> Store:
    """The samples backfilled, in an evaluator's store (no staleness: a backfill has none)."""
    out = Store(retention_ms=10 ** 12)
    for t, labels, value in sorted((t * 1000, labels_of({**pairs, "__name__": name}), v)
                                   for name, pairs, v, t in samples(CASES)):
        out.append(labels, t, value)
    return out


def same(a: dict[tuple, float], b: dict[tuple, float]) -> bool:
    return a.keys() == b.keys() and all(
        math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) or a[k] == b[k] for k in a)


def test_the_evaluator_answers_every_query_as_prometheus_did(results, store):
    """Every query diagnose sent and every alert's condition, at every case's time: the same
    label sets with the same values from the evaluator over the same samples."""
    differ, asked, elapsed = [], 0, 0.0
    for t, answered in sorted(ANSWERED.items()):
        engine = Engine(store, t * 1000)
        for expr, truth in answered.items():
            started = time.perf_counter()
            ours = answers(engine.query(expr))
            elapsed += time.perf_counter() - started
            asked += 1
            if not same(truth, ours):
                differ.append((t - BASE, expr, truth, ours))
    print(f"{asked} queries at {len(ANSWERED)} times, the evaluator's CPU: {elapsed:.1f} s")
    assert len(ANSWERED) == len(TIMES) and asked > 150 * len(TIMES)
    assert not differ, "\n\n".join(
        f"at +{t}s: {expr}\nPrometheus: {truth}\nevaluator:  {ours}"
        for t, expr, truth, ours in differ[:5]) + f"\n({len(differ)} differ)"


def test_what_the_evaluator_does_not_evaluate_is_an_error_naming_it():
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
    # matching: many-to-one with a label copied from the one side; one-to-many; ignoring;
    # set operations
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
def test_the_corners_of_the_language_are_evaluated_as_prometheus_does(backfilled, store, expr):
    held = 0
    for t in TIMES[::4]:
        truth = answers(Prometheus(backfilled.url, at=str(t)).query(expr))
        ours = answers(Engine(store, t * 1000).query(expr))
        held += len(truth)
        assert same(truth, ours), (expr, t - BASE, truth, ours)
    assert held, f"{expr} holds nothing at any time: no corner tested"


def test_a_match_prometheus_refuses_the_evaluator_refuses(backfilled, store):
    expr = ("gputrain_training_steps_total * on (job, instance) group_left (uuid) "
            "max by (job, instance, uuid) (gputrain_gpu_power_watts)")
    refused = 0
    for t in TIMES:
        try:
            truth = answers(Prometheus(backfilled.url, at=str(t)).query(expr))
        except PrometheusError as exc:
            assert "many-to-many" in str(exc)
            refused += 1
            with pytest.raises(QueryError, match="many-to-many"):
                Engine(store, t * 1000).query(expr)
        else:  # where the right side happens to be unique, both answer
            assert same(truth, answers(Engine(store, t * 1000).query(expr)))
    assert refused


def test_a_series_gone_from_a_scrape_is_stale_at_once_and_its_past_kept():
    """As Prometheus marks a series that a scrape no longer has: an instant query no longer
    returns it (rather than its last value for five minutes), a range still holds its past."""
    a, b = (labels_of({"__name__": "x", "gpu": g}) for g in "ab")
    store = Store(retention_ms=60_000)
    for t, present in ((0, (a, b)), (10_000, (a, b)), (20_000, (a,)), (30_000, (a,))):
        store.append_all(t, [(labels, t / 1000) for labels in present])

    def at(t: int, expr: str) -> dict[str, float]:
        return {dict(lb)["gpu"]: v for lb, v in answers(Engine(store, t).query(expr)).items()}

    assert at(15_000, "x") == {"a": 10.0, "b": 10.0}
    assert at(25_000, "x") == {"a": 20.0}  # b went stale at 20 s
    assert at(30_000, "count_over_time(x[1m])") == {"a": 4.0, "b": 2.0}
    store.append_all(40_000, [(a, 40.0), (b, 40.0)])  # b is back
    assert at(40_000, "x") == {"a": 40.0, "b": 40.0}
    store.prune(100_000)  # keep the last minute: from 40 s
    assert at(100_000, "count_over_time(x[2m])") == {"a": 1.0, "b": 1.0}
    store.prune(200_000)
    assert len(store) == 0
