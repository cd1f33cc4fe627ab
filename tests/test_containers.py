"""Trainers in containers: NVML lists host pids, a containerised rank pushes the pid it sees
and its start time; the daemon joins them through the host's /proc (NSpid, start time).

Real PID namespaces (``unshare --pid --fork --mount-proc``, as root in CI), never a scripted
pid table; the demo backend lists a trainer's host pid as NVML would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest
import requests
from conftest import ROOT, sample_value, wait_until

from exporter.reading.gpu_backends import GpuIdentity, GpuSample
from exporter.reading.host_processes import find_host_pid, read_process
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import Owners
from exporter.serving.ingest import IngestStore

GIB = 2**30
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
# prints its own pid and start time (as a trainer's client pushes them), starts a child (a
# DataLoader worker) that prints its pid, then sleeps
CONTAINED = (
    "import os, subprocess, sys, time\n"
    "start = open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(os.getpid(), start, child.pid, flush=True)\n"
    "time.sleep(600)\n")

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or psutil.LINUX is False,
                                reason="needs util-linux unshare on Linux")


class Contained:
    """A process tree in a PID namespace of its own: what it calls itself and its host pids."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([*UNSHARE, sys.executable, "-c", CONTAINED],
                                     stdout=subprocess.PIPE, text=True)
        own, start, child = self.proc.stdout.readline().split()
        self.ns_pid, self.start, self.ns_child = int(own), int(start), int(child)
        main = psutil.Process(self.proc.pid).children()[0]
        self.host_pid = main.pid
        self.host_child = wait_until(lambda: [c.pid for c in main.children()],
                                     what="the contained child")[0]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def two_containers() -> Iterator[tuple[Contained, Contained]]:
    a = Contained()
    try:
        b = Contained()
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def push(store: IngestStore, rank: str, pid: int, start: int | None) -> None:
    proc = {"pid": pid} if start is None else {"pid": pid, "start_time": start}
    store.push(json.dumps({"version": 1, "run": "boxed", "rank": rank, "run_id": f"r{rank}",
                           "steps": 1, "step_seconds": 1.0, "data_wait_seconds": 0.0,
                           "samples": 8, "process": proc}).encode())


def snapshot(memory: dict[int, float]) -> Snapshot:
    gpu = GpuState(GpuIdentity("0", "GPU-0"), up=True,
                   sample=GpuSample(0.0, pids=tuple(memory), process_memory=memory))
    return Snapshot(1, 0.0, "test", "", (gpu,))


def test_the_host_sees_a_contained_process_as_pid_1_by_nspid_and_start_time(two_containers):
    a, b = two_containers
    assert a.ns_pid == b.ns_pid == 1  # the same pid in every container: not enough to join
    p = read_process(a.host_pid)
    assert p is not None and (p.ns_pid, p.start_ticks) == (1, a.start)
    assert find_host_pid(1, a.start) == a.host_pid
    assert find_host_pid(1, b.start) == b.host_pid
    assert find_host_pid(a.ns_child, a.start) is None  # the child started later


def test_a_contained_rank_owns_its_process_and_child_and_not_another_containers_pid_1(
        two_containers):
    """Two containers' pid 1 (and a's child, a DataLoader worker) on one GPU; rank 0 pushes
    a's pid 1 and start time: a's processes are rank 0's, b's pid 1 is a stranger's."""
    a, b = two_containers
    store = IngestStore()
    push(store, "0", 1, a.start)
    snap = snapshot({a.host_pid: 30 * GIB, a.host_child: 2 * GIB, b.host_pid: 5 * GIB})
    ranks, others = Owners().attribute(snap, store.states())
    assert ranks == {("boxed", "0"): {("0", "GPU-0"): 32 * GIB}}
    assert others == {("0", "GPU-0"): (1, 5 * GIB)}


def test_pid_1_without_its_start_time_is_not_a_contained_rank(two_containers):
    """The near miss: a rank that pushes pid 1 with another start time owns nothing."""
    a, b = two_containers
    store = IngestStore()
    push(store, "0", 1, a.start + 12345)
    ranks, others = Owners().attribute(snapshot({a.host_pid: GIB, b.host_pid: GIB}),
                                       store.states())
    assert ranks == {} and others == {("0", "GPU-0"): (2, 2 * GIB)}


def contained_client(run: str, endpoint: str) -> subprocess.Popen:
    """``examples/synthetic_client.py`` in a PID namespace of its own, as in a container."""
    return subprocess.Popen(
        [*UNSHARE, sys.executable, str(ROOT / "examples" / "synthetic_client.py"), "--run", run,
         "--push-interval", "0.5", "--data-wait-ms", "10", "--compute-ms", "30"], cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GPUTRAIN_URL": endpoint,
             "CUDA_VISIBLE_DEVICES": "0", "RANK": "0"})


def test_a_containerised_trainers_gpu_share_is_its_own_and_no_gpu_is_shared(daemon_factory):
    """The daemon on the host, the trainer in its own PID namespace (it pushes pid 1): the
    demo lists the trainer's host pid as NVML would; the rank's busy seconds are the GPU's
    and nothing is unattributed (before the NSpid join: all of it was, and the GPU read as
    shared)."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--sampler.interval=0.2")
    client = contained_client("boxed", d.ingest_url)
    try:
        mine = {"run": "boxed", "rank": "0", "gpu": "0"}

        def both() -> tuple[float, float, float] | None:
            text = d.metrics()
            rank = sample_value(text, "gputrain_training_gpu_busy_seconds_total", mine)
            other = sample_value(text, "gputrain_gpu_unattributed_busy_seconds_total",
                                 {"gpu": "0"})
            busy = sample_value(text, "gputrain_gpu_busy_seconds_total", {"gpu": "0"})
            return (rank, other, busy) if rank and rank > 1.0 and other is not None else None

        first = wait_until(both, timeout=60, what="the contained rank's busy seconds")
        later = wait_until(lambda: (b := both()) and b[0] > first[0] + 1.0 and b,
                           timeout=60, what="more busy seconds")
        assert later[1] == 0.0  # nothing busy on GPU 0 is a stranger's
        # the rank's share of what the GPU was busy (the GPU's counter lags a cycle at most)
        assert (later[0] - first[0]) == pytest.approx(later[2] - first[2], rel=0.25)
        doc = wait_until(lambda: (s := requests.get(d.url + "/api/v1/status",
                                                    timeout=10).json())["runs"] and s,
                         timeout=60, what="the run in /api/v1/status")
        assert doc["attribution"] is None
        verdicts = [v["verdict"] for r in doc["runs"] for v in r["verdicts"]]
        assert "gpu-shared" not in verdicts
        (g0,) = [g for g in doc["gpus"] if g["gpu"] == "0"]
        assert [s["busy"] for s in g0["shares"] if s["run"] is None] == [0.0]
    finally:
        client.kill()
        client.wait()


def test_a_contained_rank_killed_outright_reads_failed_killed(daemon_factory):
    """The daemon on the host, the trainer in its own PID namespace (it pushes pid 1 and its
    start time): the daemon finds its host pid by NSpid and start time, and when the trainer
    is killed (SIGKILL, as the OOM killer kills: no goodbye) it reads failed, killed, within
    a cycle or two, not silent for a minute and vanished after two."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--sampler.interval=0.2")
    client = contained_client("boxed-kill", d.ingest_url)
    try:
        mine = {"run": "boxed-kill", "rank": "0"}
        # its busy seconds on the GPU: the sampler's cycles have seen it for over a second,
        # so the daemon has looked for its process (once a second) while it ran
        wait_until(lambda: (sample_value(d.metrics(), "gputrain_training_gpu_busy_seconds_total",
                                         {**mine, "gpu": "0"}) or 0) > 1.5,
                   timeout=60, what="the contained rank's busy seconds")
        (trainer,) = psutil.Process(client.pid).children()
        assert read_process(trainer.pid).ns_pid == 1  # the pid it pushes is not its host pid
        trainer.kill()
        wait_until(lambda: sample_value(d.metrics(), "gputrain_training_exit_info",
                                        {**mine, "reason": "killed", "detail": ""}) == 1.0,
                   timeout=30, what=lambda: f"rank 0 killed: {d.log_text()[-800:]}")
        assert sample_value(d.metrics(), "gputrain_training_failed", mine) == 1.0
    finally:
        client.kill()
        client.wait()


def test_a_daemon_that_cannot_read_the_hosts_processes_says_so_and_claims_no_share(
        daemon_factory):
    """The daemon in a PID namespace of its own (no hostPID): NVML's host pid of the trainer
    is not in its /proc. The rank's GPU still comes from what it pushes, its share and the
    GPU's unattributed share are unknown (absent, never 0 or all), and the status document
    and the log say why and what to do."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--sampler.interval=0.2",
                       start=False)
    d.args = [*UNSHARE, *d.args]
    d.start()
    client = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "synthetic_client.py"), "--run", "hidden",
         "--push-interval", "0.5"], cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GPUTRAIN_URL": d.ingest_url,
             "CUDA_VISIBLE_DEVICES": "0", "RANK": "0"})
    try:
        doc = wait_until(lambda: (s := requests.get(d.url + "/api/v1/status",
                                                    timeout=10).json())["attribution"] and s,
                         timeout=60, what="the attribution note")
        assert doc["attribution"]["unresolved_processes"] == 1
        assert doc["attribution"]["gpus"] == ["0"]
        assert "hostPID" in doc["attribution"]["note"]
        text = d.metrics()
        assert sample_value(text, "gputrain_training_gpu_info",
                            {"run": "hidden", "rank": "0", "gpu": "0"}) == 1
        assert sample_value(text, "gputrain_training_gpu_busy_seconds_total",
                            {"run": "hidden", "rank": "0", "gpu": "0"}) is None
        assert sample_value(text, "gputrain_gpu_unattributed_busy_seconds_total",
                            {"gpu": "0"}) is None
        assert sample_value(text, "gputrain_gpu_unattributed_processes", {"gpu": "0"}) is None
        (g0,) = [g for g in doc["gpus"] if g["gpu"] == "0"]
        assert all(s["run"] is not None for s in g0["shares"])
        assert d.log_text().count("cannot be read in /proc") == 1
    finally:
        client.kill()
        client.wait()


@pytest.mark.parametrize("start", [-1, 1.5, "12", True])
def test_a_bad_start_time_is_refused_naming_the_field(start):
    with pytest.raises(Exception, match=r"process\.start_time") as info:
        push(IngestStore(), "0", 1, start)
    assert info.value.status == 400
