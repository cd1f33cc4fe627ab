"""Shared GPUs: each rank's share of its GPU, and the share no rank owns.

The sampler integrates NVML's per-process utilisation into busy seconds per process; once per
cycle the attribution sums them by owner (a rank's pushed pid or a descendant of it); the page
exports them as counters, the history judges a run's foreign share, and GpuTrainGPUShared
fires on it.
"""

from __future__ import annotations

import json

import pytest

from exporter.heuristics.rules import DEFAULTS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.gpu_backends import GpuIdentity, GpuSample
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import Attribution, Owners
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView

T = DEFAULTS["thresholds"]
BASE = 1_700_000_000.0
PARENTS = {101: 100, 100: 1, 200: 1, 300: 1}  # 101: a DataLoader worker of rank 0's 100


def push(store: IngestStore, run: str, rank: str, pid: int, k: int, now: float) -> None:
    store.push(json.dumps({
        "version": SCHEMA_VERSION, "run": run, "rank": rank, "run_id": f"{run}{rank}",
        "steps": 10 * k, "step_seconds": float(k), "data_wait_seconds": 0.01 * k,
        "samples": 320 * k, "elapsed_seconds": float(k), "last_step_timestamp": now,
        "gpus": ["0"], "process": {"pid": pid}}).encode())


def gpu_state(t: float, busy: dict[int, float]) -> GpuState:
    """GPU 0 after ``t`` seconds, each pid of ``busy`` keeping it busy that share of the time."""
    sample = GpuSample(BASE + t, utilization=min(1.0, sum(busy.values())),
                       memory_used_bytes=40e9, memory_total_bytes=80e9, power_watts=500.0,
                       power_limit_watts=700.0, pids=tuple(busy),
                       process_utilization={pid: (share, share / 2)
                                            for pid, share in busy.items()})
    return GpuState(GpuIdentity("0", "GPU-0", "NVIDIA H100 80GB HBM3"), up=True, sample=sample,
                    sampled_seconds=t, busy_seconds=t * sample.utilization,
                    process_busy_seconds={p: s * t for p, s in busy.items()},
                    process_memory_busy_seconds={p: s * t / 2 for p, s in busy.items()})


def test_each_ranks_busy_seconds_and_the_unowned_are_summed_by_owner():
    """Rank 0's pid and its DataLoader worker count for rank 0; a process no rank pushed is
    unattributed; a snapshot seen twice counts once; a rank that is gone is forgotten."""
    views = Attribution(Owners(parent_of=PARENTS.get))
    store = IngestStore(clock=lambda: BASE, wall_clock=lambda: BASE)
    push(store, "a", "0", 100, 1, BASE)
    push(store, "b", "0", 200, 1, BASE)
    busy = {100: 0.3, 101: 0.1, 200: 0.2, 300: 0.25}
    for k in range(1, 11):
        snap = Snapshot(k, BASE + k, "nvml", "", (gpu_state(float(k), busy),))
        views.update(snap, store.states())
        views.update(snap, store.states())  # a cycle's join is made once
    ranks, others = views.latest.busy, views.latest.unowned
    gpu = ("0", "GPU-0")
    assert ranks[("a", "0")][gpu] == pytest.approx((4.0, 2.0))  # 0.3 + 0.1, over 10 s
    assert ranks[("b", "0")][gpu] == pytest.approx((2.0, 1.0))
    assert others[gpu] == pytest.approx((2.5, 1.25))
    total = sum(b for b, _ in (ranks[("a", "0")][gpu], ranks[("b", "0")][gpu], others[gpu]))
    assert total == pytest.approx(0.85 * 10)  # the GPU's busy seconds
    gone = IngestStore(clock=lambda: BASE, wall_clock=lambda: BASE)
    push(gone, "a", "0", 100, 1, BASE)  # rank b stopped pushing
    views.update(Snapshot(11, BASE + 11, "nvml", "", (gpu_state(11.0, busy),)), gone.states())
    ranks, others = views.latest.busy, views.latest.unowned
    assert set(ranks) == {("a", "0")}
    assert others[gpu] == pytest.approx((2.5 + 0.25 + 0.2, 1.25 + 0.125 + 0.1))  # b's is others'


@pytest.mark.parametrize("stranger", [True, False])
def test_a_run_on_a_shared_gpu_is_named_with_its_share_and_the_others(stranger):
    """The history's window: each run sees the others' and the unattributed share as foreign;
    GpuTrainGPUShared's finding names it on the run's card, and the GPU row lists the shares.
    Two runs alone on a GPU (no stranger) see each other: the unattributed share is 0."""
    now = [BASE]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    views = Attribution(Owners(parent_of=PARENTS.get))
    history = History(window=60.0, point_seconds=5.0, instance="n1")
    view = StatusView(history, T, backend="nvml")
    busy = {100: 0.5, 200: 0.2, 300: 0.25} if stranger else {100: 0.5, 200: 0.2}
    for k in range(40):
        now[0] = BASE + k
        push(store, "a", "0", 100, k, now[0])
        push(store, "b", "0", 200, k, now[0])
        history.observe(views.update(
            Snapshot(k, now[0], "nvml", "", (gpu_state(float(k), busy),)), store.states()))
    doc = view.document()
    (gpu,) = doc["gpus"]
    got = {(s["run"], s["rank"]): s["busy"] for s in gpu["shares"]}
    assert got == {("a", "0"): pytest.approx(0.5), ("b", "0"): pytest.approx(0.2),
                   (None, None): pytest.approx(0.25 if stranger else 0.0)}
    runs = {r["run"]: r for r in doc["runs"]}
    for run, foreign in ((("a", "45.0%"), ("b", "75.0%")) if stranger else
                         (("a", "20.0%"), ("b", "50.0%"))):
        (rank,) = runs[run]["ranks"]
        found = {rank["verdict"]: rank["reason"],
                 **{a["verdict"]: a["reason"] for a in rank["also"]}}
        assert found["gpu-shared"] == (f"GPU 0: busy {foreign} of the time with processes "
                                       "not this run's"), found


def _busy(text: str) -> tuple[float, float, float, float]:
    """(the GPU's busy seconds, the ranks' summed, the unattributed, the seconds watched) on a
    /metrics page."""
    from conftest import sample_value
    from prometheus_client.parser import text_string_to_metric_families

    ranks = sum(s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "gputrain_training_gpu_busy_seconds_total")
    return (sample_value(text, "gputrain_gpu_busy_seconds_total", {"gpu": "0"}) or 0.0, ranks,
            sample_value(text, "gputrain_gpu_unattributed_busy_seconds_total",
                         {"gpu": "0"}) or 0.0,
            sample_value(text, "gputrain_gpu_sampled_seconds_total", {"gpu": "0"}) or 0.0)


def test_two_ranks_and_a_foreign_process_share_one_gpu_end_to_end(daemon_factory, tmp_path,
                                                                   prometheus_factory):
    """A demo GPU shared by two ranks of a run and a process no client reports (30 % of the
    time): the ranks' and the unattributed busy seconds add up to the GPU's within 5 %, the
    status view and top show the shares and name the sharing, and GpuTrainGPUShared fires in
    a real Prometheus."""
    import subprocess
    import sys

    import requests
    from conftest import ROOT, rules_file, synthetic_client, wait_until

    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--demo.foreign-load=0.3")
    clients = [synthetic_client("pair", daemon.ingest_url, "--data-wait-ms", "30",
                                "--compute-ms", "10", rank=r, gpu=0) for r in (0, 1)]
    try:
        first = wait_until(lambda: (t := _busy(daemon.metrics()))[1] > 0 and t[2] > 0 and t,
                           timeout=60, what="both ranks' and the foreign busy seconds")
        wait_until(lambda: _busy(daemon.metrics())[0] - first[0] > 10, timeout=60,
                   what="ten more busy seconds of the GPU")
        last = _busy(daemon.metrics())
        gpu, ranks, foreign, watched = (b - a for a, b in zip(first, last, strict=True))
        assert ranks + foreign == pytest.approx(gpu, rel=0.05), (gpu, ranks, foreign)
        assert foreign / watched == pytest.approx(0.3, abs=0.03)  # the foreign process's load

        def judged() -> dict | None:
            doc = requests.get(daemon.url + "/api/v1/status", timeout=10).json()
            ranks = doc["runs"][0]["ranks"] if doc["runs"] else []
            found = [{r["verdict"], *(a["verdict"] for a in r["also"])} for r in ranks]
            return doc if len(found) == 2 and all("gpu-shared" in f for f in found) else None

        doc = wait_until(judged, timeout=60, what="gpu-shared for both ranks")
        shares = {(s["run"], s["rank"]) for s in doc["gpus"][0]["shares"]}
        assert shares == {("pair", "0"), ("pair", "1"), (None, None)}
        top = subprocess.run([sys.executable, "-m", "exporter", "top", "--once", "--url",
                              daemon.url], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert top.returncode == 0 and "others " in top.stdout, top.stdout + top.stderr
        assert "gpu-shared" in top.stdout
        rules = rules_file(tmp_path, {"recording_interval": "1s",
                                      "for": {"GpuTrainGPUShared": "1s"}})
        prom = prometheus_factory([daemon.url.removeprefix("http://")],
                                  rule_files=[str(rules)])
        alerts = wait_until(lambda: prom.query(
            'ALERTS{alertname="GpuTrainGPUShared",alertstate="firing"}'), timeout=90,
            what="GpuTrainGPUShared firing")
        assert {(a["metric"]["run"], a["metric"]["gpu"]) for a in alerts} == {("pair", "0")}
    finally:
        for c in clients:
            c.kill()
            c.wait()


def _shared_then(leaver: int) -> tuple[dict, dict]:
    """Run a (pid 100) shares GPU 0 for 40 s with run b (pid 200) and a stranger (pid 300);
    then ``leaver``'s process exits (run b's rank still pushes: a killed trainer's rank lives
    until its pushes expire). Run a's findings just before the exit and one cycle after."""
    now = [BASE]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    views = Attribution(Owners(parent_of=PARENTS.get))
    history = History(window=300.0, point_seconds=5.0, instance="n1")
    view = StatusView(history, T, backend="nvml")
    busy = {100: 0.5, 200: 0.2, 300: 0.25}
    seconds = {pid: 0.0 for pid in busy}
    found = []
    for k in range(42):
        now[0] = BASE + k
        if k == 41:
            busy = {p: v for p, v in busy.items() if p != leaver}
        for pid, share in busy.items():
            seconds[pid] += share
        push(store, "a", "0", 100, k, now[0])
        push(store, "b", "0", 200, k, now[0])
        st = gpu_state(float(k), busy)
        st = GpuState(st.identity, up=True, sample=st.sample, sampled_seconds=float(k),
                      busy_seconds=st.busy_seconds,
                      process_busy_seconds={p: seconds[p] for p in busy},
                      process_memory_busy_seconds={p: seconds[p] / 2 for p in busy})
        history.observe(views.update(Snapshot(k, now[0], "nvml", "", (st,)), store.states()))
        if k in (40, 41):
            doc = view.document()
            (rank,) = {r["run"]: r for r in doc["runs"]}["a"]["ranks"]
            found.append({rank["verdict"]: rank["reason"],
                          **{a["verdict"]: a["reason"] for a in rank["also"]}})
    return found[0], found[1]


@pytest.mark.parametrize("leaver, before, after", [
    (200, "45.0%", "25.0%"),  # run b killed: its share leaves; the stranger's stays
    (300, "45.0%", "20.0%"),  # the stranger exits: run b's share stays
])
def test_a_share_leaves_the_window_with_its_process(leaver, before, after):
    """A process that exits takes its share of the GPU out of the window at once (not five
    minutes later): run a's foreign share falls to what the processes still on the GPU had;
    those that stay keep counting their past busy time (the near miss)."""
    was, now = _shared_then(leaver)
    assert was["gpu-shared"] == f"GPU 0: busy {before} of the time with processes not this run's"
    assert now["gpu-shared"] == f"GPU 0: busy {after} of the time with processes not this run's"


def test_a_run_alone_once_the_others_exit_is_not_shared():
    """Both other processes gone: nothing of them is left in run a's window."""
    now = [BASE]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    views = Attribution(Owners(parent_of=PARENTS.get))
    history = History(window=300.0, point_seconds=5.0, instance="n1")
    view = StatusView(history, T, backend="nvml")
    for k in range(45):
        now[0] = BASE + k
        push(store, "a", "0", 100, k, now[0])
        push(store, "b", "0", 200, k, now[0])
        busy = {100: 0.5, 200: 0.2, 300: 0.25} if k <= 40 else {100: 0.5}
        st = gpu_state(float(k), busy)
        if k > 40:  # the others' seconds stop at 40 s; pid 100's go on
            st = GpuState(st.identity, up=True, sample=st.sample, sampled_seconds=float(k),
                          busy_seconds=st.busy_seconds,
                          process_busy_seconds={100: 0.5 * k},
                          process_memory_busy_seconds={100: 0.25 * k})
        history.observe(views.update(Snapshot(k, now[0], "nvml", "", (st,)), store.states()))
    doc = view.document()
    (rank,) = {r["run"]: r for r in doc["runs"]}["a"]["ranks"]
    found = {rank["verdict"], *(a["verdict"] for a in rank["also"])}
    assert "gpu-shared" not in found, rank
    (gpu,) = doc["gpus"]
    assert {(s["run"], s["rank"]): s["busy"] for s in gpu["shares"]} == {
        ("a", "0"): pytest.approx(0.5), (None, None): 0.0}


def two_gpus(t: float, work: dict[str, dict[int, float]],
             held: dict[str, dict[int, float]]) -> tuple[GpuState, ...]:
    """H100s 0 and 1 after ``t`` seconds: on each, the pids of ``work`` keep it busy that share
    of the time, and the pids of ``held`` hold those bytes (a pid may hold memory and do
    nothing: a stray CUDA context)."""
    out = []
    for index in ("0", "1"):
        busy, memory = work.get(index, {}), held.get(index, {})
        sample = GpuSample(BASE + t, utilization=min(1.0, sum(busy.values())),
                           memory_used_bytes=sum(memory.values()), memory_total_bytes=80e9,
                           power_watts=500.0, power_limit_watts=700.0, pids=tuple(memory),
                           process_memory=dict(memory),
                           process_utilization={p: (s, s / 2) for p, s in busy.items()})
        out.append(GpuState(GpuIdentity(index, f"GPU-{index}", "NVIDIA H100 80GB HBM3"),
                            up=True, sample=sample, sampled_seconds=t,
                            busy_seconds=t * sample.utilization,
                            process_busy_seconds={p: s * t for p, s in busy.items()},
                            process_memory_busy_seconds={p: s * t / 2 for p, s in busy.items()}))
    return tuple(out)


@pytest.mark.parametrize("stray", [True, False])
def test_a_stray_context_is_said_and_adds_nothing_to_the_ranks_capacity(stray):
    """Rank 1 of a data-parallel run trains on GPU 1 and (``stray``) holds 512 MiB on GPU 0,
    rank 0's, doing nothing there (a torch.load without map_location): the page says so
    beside its verdict, its MFU counts GPU 1 alone, and GPU 0 at 60 % is rank 0's to use,
    not rank 1's. Without the stray context nothing is said and the MFU is the same (the near
    miss: before, the stray GPU halved it)."""
    now = [BASE]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    views = Attribution(Owners(parent_of={100: 1, 400: 1}.get))
    history = History(window=60.0, point_seconds=5.0, instance="n1")
    view = StatusView(history, T, backend="nvml")
    work = {"0": {100: 0.6}, "1": {400: 0.95}}
    held = {"0": {100: 40e9, **({400: 2**29} if stray else {})}, "1": {400: 40e9}}
    for k in range(40):
        now[0] = BASE + k
        for rank, pid, gpu in (("0", 100, "0"), ("1", 400, "1")):
            store.push(json.dumps({
                "version": SCHEMA_VERSION, "run": "dp", "rank": rank, "run_id": f"dp{rank}",
                "steps": 10 * k, "step_seconds": float(k), "data_wait_seconds": 0.0,
                "samples": 320 * k, "elapsed_seconds": float(k), "last_step_timestamp": now[0],
                "flops": 3e14 * k, "precision": "bf16", "gpus": [gpu],
                "process": {"pid": pid}}).encode())
        history.observe(views.update(
            Snapshot(k, now[0], "nvml", "", two_gpus(float(k), work, held)), store.states()))
    (run,) = view.document()["runs"]
    ranks = {r["rank"]: r for r in run["ranks"]}
    also = {a["verdict"]: a["reason"] for a in ranks["1"]["also"]}
    if stray:
        assert also.get("stray-context") == ("holds 512 MiB on GPU 0 where it does no work: a "
                                             "stray CUDA context"), ranks["1"]
    else:
        assert "stray-context" not in also
    assert "stray-context" not in {a["verdict"] for a in ranks["0"]["also"]}
    assert ranks["1"]["verdict"] == "gpu-bound", ranks["1"]  # a note is never the verdict
    assert ranks["0"]["verdict"] == "underutilized", ranks["0"]
    reports = {r.rank: r for r in history.reports()}
    # 3e14 FLOP/s of one H100's dense bf16 peak, whether or not it also holds GPU 0
    assert reports["0"].mfu and reports["1"].mfu == pytest.approx(reports["0"].mfu)
    assert reports["1"].gpu_share == pytest.approx({"1": 1.0, **({"0": 0.0} if stray else {})})
