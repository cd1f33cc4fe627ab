"""A run has the CPUs its cgroup gives it, not the node's: the client's cgroup v2 reading, and
the daemon's verdict on a rank at its quota on an idle node (the promtool case and diagnose
through a real Prometheus are in rule_cases.py and test_agreement.py)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import cgroup_tree

from exporter.client.cgroup import CgroupCpu, count_cpus
from exporter.heuristics.rules import DEFAULTS
from exporter.heuristics.verdict import judge
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.collectors.cpu import CpuReading
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore

T = DEFAULTS["thresholds"]


def test_the_allowance_is_the_tightest_quota_or_cpuset_on_the_path(tmp_path):
    proc, root = cgroup_tree(tmp_path, "400000 100000", throttled_usec=2_500_000)
    got = CgroupCpu(42, str(proc), (str(root),)).read()
    got.pop("cpu_allowance_group", None)  # where the quota limits it (a machine over 4 CPUs)
    assert got == {"cpu_allowance_cores": min(4.0, os.cpu_count()),
                   "cpu_throttled_seconds": 2.5}
    proc, root = cgroup_tree(tmp_path / "b", "max", cpuset="0-1")
    assert CgroupCpu(42, str(proc), (str(root),)).read()["cpu_allowance_cores"] == \
        min(2.0, os.cpu_count())
    assert count_cpus("0-3,8,10-11") == 7


def test_without_cgroup_v2_nothing_is_claimed(tmp_path):
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text("4:memory:/x\n1:cpu:/\n")  # cgroup v1 only
    assert CgroupCpu(42, str(proc), (str(tmp_path),)).read() == {}


def test_the_ranks_under_one_limit_say_the_same_group(tmp_path):
    """Two processes in two containers of one pod, its quota (1 core: below this machine's
    CPUs) on the pod: both name the pod's cgroup as where their allowance comes from."""
    proc, root = cgroup_tree(tmp_path, "100000 100000")
    (root / "kubepods" / "pod1" / "ctr2").mkdir()
    (proc / "43").mkdir()
    (proc / "43" / "cgroup").write_text("0::/kubepods/pod1/ctr2\n")
    a, b = (CgroupCpu(pid, str(proc), (str(root),)).read() for pid in (42, 43))
    assert a["cpu_allowance_cores"] == b["cpu_allowance_cores"] == 1.0
    assert a["cpu_allowance_group"] == b["cpu_allowance_group"] == \
        (root / "kubepods" / "pod1").stat().st_ino
    free, froot = cgroup_tree(tmp_path / "free", "max", cpuset=f"0-{os.cpu_count() - 1}")
    assert "cpu_allowance_group" not in CgroupCpu(42, str(free), (str(froot),)).read()


def rank_on_idle_node(cores_used: float, allowance: float, throttled: float,
                      ranks: tuple[tuple[str, int | None], ...] = (("0", None),)) -> list:
    """Ten minutes of a rank 50 % input-bound whose process tree uses ``cores_used`` cores of
    the ``allowance`` its cgroup gives it, throttled ``throttled`` of the time, pushed every
    5 s, on a 128-core node 10 % busy; judged from the daemon's history. ``ranks``: each rank
    and the cgroup group its allowance comes from (None: it says none)."""
    now = [1000.0]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(window=300.0, point_seconds=5.0, instance="n1")
    views = Attribution()
    for k in range(121):
        t = 5.0 * k
        now[0] = 1000.0 + t
        for rank, group in ranks:
            store.push(json.dumps({
                "version": SCHEMA_VERSION, "run": "r", "rank": rank, "run_id": "a" + rank,
                "steps": int(t * 10), "step_seconds": t, "data_wait_seconds": 0.5 * t,
                "samples": 320 * t, "elapsed_seconds": t,
                "process": {"cpu_seconds": cores_used * t, "resident_memory_bytes": 1e9,
                            "cpu_allowance_cores": allowance,
                            "cpu_throttled_seconds": throttled * t,
                            **({"cpu_allowance_group": group} if group is not None
                               else {})}}).encode())
        host = {"cpu": CpuReading({"user": 128 * 0.1 * t, "idle": 128 * 0.9 * t,
                                   "iowait": 0.0}, 128)}
        history.observe(views.update(Snapshot(k, now[0], "test", "", (), host), store.states()))
    return judge(history.reports(), T)


@pytest.mark.parametrize("cores_used, allowance, throttled, verdict", [
    (3.9, 4.0, 0.0, "cpu-quota-bound"),  # at its quota, the node idle
    (3.0, 4.0, 0.3, "cpu-quota-bound"),  # throttled 30 % of the time
    (2.0, 4.0, 0.0, "input-bound"),  # half its allowance: more workers would help
])
def test_a_rank_at_its_quota_on_an_idle_node_is_cpu_bound(cores_used, allowance, throttled,
                                                          verdict):
    (rep,) = rank_on_idle_node(cores_used, allowance, throttled)
    assert rep.verdict == verdict, rep.reason
    assert rep.cpu_allowance_used == pytest.approx(cores_used / allowance)
    if verdict == "cpu-quota-bound":
        assert "Raise the pod's (or job's) CPU limit" in rep.advice
        assert [f.name for f in rep.also] == ["input-bound"]


@pytest.mark.parametrize("groups, used, verdict", [
    ((7, 7), 2.0, "cpu-quota-bound"),  # one pod's 4 cores, each rank using 2: at its limit
    ((7, 7, 7, 7), 1.0, "cpu-quota-bound"),
    ((7, 8), 2.0, "input-bound"),  # two pods of 4 cores each: each rank at half of its own
    ((None, None), 2.0, "input-bound"),  # no group said: each judged on the whole allowance
])
def test_ranks_sharing_one_allowance_are_judged_on_their_part_of_it(groups, used, verdict):
    ranks = tuple((str(i), g) for i, g in enumerate(groups))
    reports = rank_on_idle_node(used, 4.0, 0.0, ranks)
    shared = len(groups) if groups[0] is not None and len(set(groups)) == 1 else 1
    for rep in reports:
        assert rep.verdict == verdict, rep.reason
        assert rep.cpu_allowance_used == pytest.approx(used / (4.0 / shared))


def test_metrics_export_each_ranks_part_of_a_shared_allowance():
    """/metrics says what the page judges: a pod's 4 cores shared by its two ranks are 2 each,
    and a rank under a limit of its own keeps all of its allowance."""
    from prometheus_client import CollectorRegistry

    from exporter.serving.training import TrainingCollector

    store = IngestStore()
    for rank, group in (("0", 7), ("1", 7), ("2", 9)):
        store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": "r", "rank": rank, "run_id": "a" + rank,
            "steps": 1, "step_seconds": 1.0, "data_wait_seconds": 0.0, "samples": 1,
            "process": {"cpu_seconds": 1.0, "cpu_allowance_cores": 4.0,
                        "cpu_allowance_group": group}}).encode())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainingCollector(store, lambda: Attribution().latest))
    cores = {rank: registry.get_sample_value("gputrain_training_process_cpu_allowance_cores",
                                             {"run": "r", "rank": rank}) for rank in "012"}
    assert cores == {"0": 2.0, "1": 2.0, "2": 4.0}
