"""A fault that persists but dips is still a fault: a GPU's memory at its ceiling two readings in
three is judged on most of the window (its median), on the daemon's page as in the rules (the
promtool case in rule_cases.py has the same GPUs)."""

from __future__ import annotations

import pytest

from exporter.heuristics.rules import DEFAULTS
from exporter.reading.gpu_backends import GpuIdentity, GpuSample
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.status import StatusView

T = DEFAULTS["thresholds"]
BASE = 1_700_000_000.0


def memory_faults(pattern: list[float]) -> tuple[float | None, list[str]]:
    """Ten minutes of GPU 0 sampled every second, its memory used ``pattern`` (shares of 80 GB)
    in turn, a reading each 10 s: the window's memory reading, and the page's GPU findings."""
    history = History(window=300.0, point_seconds=10.0, instance="n1")
    views = Attribution()
    for k in range(1, 601):
        used = pattern[(k // 10) % len(pattern)]
        sample = GpuSample(BASE + k, utilization=0.9, memory_used_bytes=used * 80e9,
                           memory_total_bytes=80e9, power_watts=500.0, power_limit_watts=700.0)
        state = GpuState(GpuIdentity("0", "GPU-0", "NVIDIA H100 80GB HBM3"), up=True,
                         sample=sample, sampled_seconds=float(k), busy_seconds=0.9 * k)
        history.observe(views.update(Snapshot(k, BASE + k, "nvml", "", (state,)), ()))
    (_, reading, _), = history.gpu_readings().values()
    doc = StatusView(history, T).document()
    return reading.memory_used, [f["verdict"] for f in doc["faults"]]


@pytest.mark.parametrize("pattern, median, near", [
    ([0.97, 0.97, 0.8], 0.97, True),  # at the ceiling two readings in three
    ([0.99, 0.99, 0.99, 0.5], 0.99, True),
    ([0.97, 0.8, 0.8], 0.8, False),  # one in three: mostly below
    ([0.9], 0.9, False),
])
def test_memory_at_the_ceiling_most_of_the_window_is_near_its_limit(pattern, median, near):
    used, faults = memory_faults(pattern)
    assert used == pytest.approx(median)
    assert ("gpu-memory-near-limit" in faults) == near, faults


def node_faults(clocks: list[float], busy: list[float]) -> dict[str, list[str]]:
    """Ten minutes of a node's identical H100s, GPU i at ``clocks[i]`` Hz of SM clock and
    ``busy[i]`` busy: the page's findings by GPU."""
    history = History(window=300.0, point_seconds=10.0, instance="n1")
    views = Attribution()
    for k in range(1, 601):
        states = []
        for i, (hz, b) in enumerate(zip(clocks, busy, strict=True)):
            sample = GpuSample(BASE + k, utilization=b, memory_used_bytes=40e9,
                               memory_total_bytes=80e9, power_watts=500.0,
                               power_limit_watts=700.0, clocks_hertz={"sm": hz})
            states.append(GpuState(GpuIdentity(str(i), f"GPU-{i}", "NVIDIA H100 80GB HBM3"),
                                   up=True, sample=sample, sampled_seconds=float(k),
                                   busy_seconds=b * k))
        history.observe(views.update(Snapshot(k, BASE + k, "nvml", "", tuple(states)), ()))
    out: dict[str, list[str]] = {}
    for f in StatusView(history, T).document()["faults"]:
        out.setdefault(f["gpu"], []).append(f["verdict"])
    return out


def test_a_gpu_at_half_its_identical_peers_clock_while_busy_is_throttled():
    """Whatever reasons its driver gives: GPU 1 at half the median clock of the node's H100s
    while 90 % busy is slowed; GPU 2 at 90 % of it, and GPU 3 at half but idle, are not."""
    faults = node_faults([2e9, 1e9, 1.8e9, 1e9, 2e9], [0.9, 0.9, 0.9, 0.1, 0.9])
    assert "throttling" in faults.get("1", [])
    assert all("throttling" not in faults.get(g, []) for g in ("0", "2", "3", "4")), faults
    # all of them held at half together (a node-wide power cap): no peer is faster
    assert "throttling" not in str(node_faults([1e9] * 4, [0.9] * 4))
