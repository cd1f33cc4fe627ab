"""A PCIe link trained down while its GPU is busy (or flapping: down most of the window),
on the daemon's own view, through the fake
driver under the real nvidia-ml-py binding (the promtool case, with host-to-device traffic
judged against the link as it runs, and diagnose through a real Prometheus are in
rule_cases.py and test_agreement.py)."""

from __future__ import annotations

import json

import pytest
from fake_nvml import FakeDriver, FakeGpu

from exporter.heuristics.rules import DEFAULTS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.gpu_backends import NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.reading.sampler import Sampler
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView

T = DEFAULTS["thresholds"]


@pytest.mark.parametrize("util, gens, degraded", [
    (95, [3], True),  # busy on Gen3 of its Gen5: a fault of the link
    (95, [5], False),  # busy at full speed
    (5, [1], False),  # idle and trained down: power saving, as it should
    (95, [3, 3, 5], True),  # flapping, down two readings in three: still a fault
    (95, [3, 5, 5], False),  # one dip in three: no fault
], ids=["down", "full", "idle", "flapping", "dip"])
def test_a_busy_gpu_on_a_link_below_its_maximum_is_degraded(clock, util, gens, degraded):
    gpu = FakeGpu("GPU-a", util_rate=util, pcie_gen=gens[0], pcie_gen_max=5, pcie_gen_gpu_max=5)
    driver = FakeDriver([gpu], clock=clock)
    sampler = Sampler(NvmlBackend(Nvml(driver.binding), clock=clock), None, interval=1.0,
                      collectors={"gpu"}, clock=clock, wall_clock=clock)
    store = IngestStore(clock=clock, wall_clock=clock)
    history = History(window=60.0, point_seconds=5.0, instance="n1")
    views = Attribution()
    view = StatusView(history, T, lambda: None, "nvml", wall_clock=clock)
    for k in range(1, 91):
        store.push(json.dumps({"version": SCHEMA_VERSION, "run": "r", "rank": "0",
                               "run_id": "a", "gpus": ["0"], "steps": 10 * k,
                               "step_seconds": float(k), "data_wait_seconds": 0.0,
                               "samples": 320.0 * k, "elapsed_seconds": float(k)}).encode())
        gpu.pcie_gen = gens[k % len(gens)]
        sampler.run_once()
        history.observe(views.update(sampler.snapshot, store.states()))
        clock.advance(1.0)
    doc = view.document()
    (rank,) = doc["runs"][0]["ranks"]
    found = [rank["verdict"], *(f["verdict"] for f in rank["also"])]
    assert ("pcie-link-degraded" in found) is degraded, rank["reason"]
    assert ("pcie-link-degraded" in [f["verdict"] for f in doc["faults"]]) is degraded
    if degraded:
        assert rank["verdict"] == "pcie-link-degraded"
        assert "15.8 GB/s of its 63.0 GB/s" in rank["reason"]
