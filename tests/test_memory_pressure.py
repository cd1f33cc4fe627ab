"""The cause before the symptom: iowait and a busy disk on a node that swaps are memory
pressure, not a slow data set, on the daemon's page (the promtool case in rule_cases.py has the
same nodes), and the memory collector reads the swapping from psutil."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from exporter.heuristics.rules import DEFAULTS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.collectors.cpu import CpuReading
from exporter.reading.collectors.memory import MemoryCollector, MemoryReading
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView

T = DEFAULTS["thresholds"]
MIB = 2**20


def verdict(iowait: float, swap_mib: float) -> tuple[str, str]:
    """Ten minutes of a rank waiting half of each step for data on an 8-CPU node 30 % busy,
    ``iowait`` of it waiting on I/O, swapping ``swap_mib`` MiB/s: its verdict and reason."""
    now = [1000.0]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(window=300.0, point_seconds=5.0, instance="n1", clock=lambda: now[0])
    views = Attribution()
    for k in range(121):
        t = 5.0 * k
        now[0] = 1000.0 + t
        store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": "r", "rank": "0", "run_id": "a",
            "steps": int(t * 10), "step_seconds": t, "data_wait_seconds": 0.5 * t,
            "samples": 320 * t, "elapsed_seconds": t}).encode())
        host = {"cpu": CpuReading({"user": 8 * 0.3 * t, "iowait": 8 * iowait * t,
                                   "idle": 8 * (0.7 - iowait) * t}, 8),
                "memory": MemoryReading(64e9, 0.5e9, swap_mib * MIB * t / 2,
                                        swap_mib * MIB * t / 2)}
        history.observe(views.update(Snapshot(k, now[0], "test", "", (), host),
                                     store.states()))
    (run,) = StatusView(history, T).document()["runs"]
    (rank,) = run["ranks"]
    return rank["verdict"], rank["reason"]


@pytest.mark.parametrize("iowait, swap_mib, expected", [
    (0.3, 20, "memory-pressure"),  # iowait, and the node pages: memory
    (0.0, 20, "memory-pressure"),
    (0.3, 0, "disk-io"),  # iowait without paging: the data set's disk
    (0.3, 1, "disk-io"),  # a little swap is no pressure
])
def test_a_swapping_node_is_memory_pressure_before_disk(iowait, swap_mib, expected):
    got, reason = verdict(iowait, swap_mib)
    assert got == expected, reason
    if expected == "memory-pressure":
        assert f"swaps {swap_mib:.1f} MiB/s" in reason


def test_the_memory_collector_reads_swapping_and_exports_it_as_counters():
    vm = SimpleNamespace(total=64e9, available=1e9)
    psutil = SimpleNamespace(virtual_memory=lambda: vm,
                             swap_memory=lambda: SimpleNamespace(sin=4096.0, sout=8192.0))
    reading = MemoryCollector(psutil_module=psutil).read()
    assert (reading.swapped_in_bytes, reading.swapped_out_bytes) == (4096.0, 8192.0)
    names = {m.name: m.samples[0].value for m in MemoryCollector(psutil_module=psutil)
             .render(reading)}
    assert names["gputrain_host_swap_in_bytes"] == 4096.0
    assert names["gputrain_host_swap_out_bytes"] == 8192.0
    # psutil without swap_memory (or no /proc/vmstat): no swap series, the rest as before
    bare = MemoryCollector(psutil_module=SimpleNamespace(virtual_memory=lambda: vm))
    assert "gputrain_host_swap_in_bytes" not in {m.name for m in bare.render(bare.read())}
