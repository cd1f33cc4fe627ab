"""Refinements have hysteresis: a verdict refined by a node reading (input-bound into
CPU-preprocessing, disk, network) is entered at the reading's line and left only below the line
less ``refinement_margin``, so a host CPU hovering at 90 % does not flip the verdict back and
forth, while a clear drop leaves it at once. The rules' side is the promtool cases in
tests/rule_cases.py (a hovering CPU keeps GpuTrainCPUPreprocessingBound firing, a drop
resolves it), and test_agreement.py holds diagnose to them."""

from __future__ import annotations

import json

from exporter.heuristics.rules import DEFAULTS
from exporter.heuristics.verdict import judge, visibility
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.collectors.cpu import CpuReading
from exporter.reading.gpu_backends import GpuIdentity, GpuSample
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore

BASE = 1_700_000_000.0
CORES = 8
HOVER = (0.99, 0.99, 0.80, 0.80)  # per minute: the 5-minute mean swings 87.6 % <-> 91.4 %


def lived(cpu_by_minute: list[float]) -> list[tuple[float, str, float | None]]:
    """A rank waiting half of each step for data, on a node whose CPUs are busy
    ``cpu_by_minute[m]`` in minute m, lived by the daemon every 5 s: (minute, the verdict, the
    node's CPU over the window) every 30 s from minute 6 on."""
    now = [BASE]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(window=300.0, point_seconds=5.0, instance="n1:19400")
    views = Attribution()
    busy_cpu, out = 0.0, []
    for k in range(12 * len(cpu_by_minute)):
        t = 5.0 * k
        now[0] = BASE + t
        busy_cpu += CORES * 5.0 * cpu_by_minute[k // 12] if k else 0.0
        store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": "aug", "rank": "0", "run_id": "a1",
            "steps": int(t), "step_seconds": t, "data_wait_seconds": 0.5 * t,
            "samples": 32 * t, "elapsed_seconds": t, "last_step_timestamp": now[0],
            "gpus": ["0"]}).encode())
        sample = GpuSample(now[0], utilization=0.4, memory_used_bytes=40e9,
                           memory_total_bytes=80e9, power_watts=300.0, power_limit_watts=700.0)
        gpu = GpuState(GpuIdentity("0", "GPU-0"), up=True, sample=sample, sampled_seconds=t,
                       busy_seconds=0.4 * t)
        host = {"cpu": CpuReading({"user": busy_cpu, "idle": CORES * t - busy_cpu,
                                   "iowait": 0.0}, CORES)}
        history.observe(views.update(Snapshot(k, now[0], "test", "", (gpu,), host), store.states()))
        if k >= 72 and k % 6 == 0:
            (rep,) = judge(visibility(history.reports()), DEFAULTS["thresholds"])
            out.append((t / 60, rep.verdict, rep.host.get("cpu_busy")))
    return out


def test_a_cpu_hovering_at_its_line_does_not_flip_the_verdict():
    """Six minutes at 95 %, then a CPU whose 5-minute mean swings across 90 % every minute or
    two: cpu-preprocessing throughout, never back to input-bound."""
    seen = lived([0.95] * 6 + list(HOVER) * 5)
    cpus = [cpu for _, _, cpu in seen if cpu is not None]
    assert min(cpus) < 0.9 < max(cpus)  # the reading does cross the line, many times
    assert {verdict for _, verdict, _ in seen} == {"cpu-preprocessing"}, seen


def test_a_clear_drop_leaves_the_refinement_at_once():
    """The near miss: the CPU falls from 95 % to 50 %: input-bound as soon as the window's
    reading is below the line less the margin (85 %), within two minutes, and for good."""
    seen = lived([0.95] * 12 + [0.5] * 8)
    before = [v for m, v, _ in seen if m <= 12]
    after = [(m, v) for m, v, _ in seen if m >= 14]
    assert set(before) == {"cpu-preprocessing"}, seen
    assert {v for _, v in after} == {"input-bound"}, seen
