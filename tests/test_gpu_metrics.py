"""The per-GPU metric descriptors (exporter/reading/gpu_metrics.py) against what the exporter
does with them: the docs' source and label columns say what the page holds, and the demo shows
each gauge its descriptor gives a figure."""

from __future__ import annotations

import pytest
from conftest import FakeClock
from fake_nvml import FakeDriver, h100_sxm, v100_sxm2
from prometheus_client import CollectorRegistry

from exporter.reading import gpu_metrics as gm
from exporter.reading.collectors import GpuCollector
from exporter.reading.gpu_backends import DemoBackend, NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.reading.sampler import Sampler


def families(backend, clock: FakeClock) -> dict[str, list]:
    """Every GPU family's samples after three cycles of ``backend``."""
    sampler = Sampler(backend, None, interval=1.0, collectors={"gpu"}, clock=clock)
    for _ in range(3):
        sampler.run_once()
        clock.advance(1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuCollector(lambda: sampler.snapshot))
    return {(f.name + "_total" if f.type == "counter" else f.name): f.samples
            for f in registry.collect()}


@pytest.mark.nvml
def test_the_label_values_the_docs_list_are_the_ones_the_page_has():
    """An H100 with a remapped row and corrected ECC errors, a V100 with retired pages: every
    labelled family the docs give values for has those values on the page, and no other."""
    clock = FakeClock()
    gpus = [h100_sxm(0, ecc_volatile={0: 3, 1: 0}, remapped_rows=(1, 0, 0, 0)),
            v100_sxm2(1, retired_pages={0: [0x1000], 1: []})]
    page = families(NvmlBackend(Nvml(FakeDriver(gpus, clock=clock).binding), clock=clock),
                    clock)
    checked = 0
    for m in gm.GPU_METRICS:
        for label, values in m.labels.items():
            if values:
                assert {s.labels[label] for s in page[m.name]} == set(values), m.name
                checked += 1
    assert checked == 4  # clock, ECC type, remap state, retirement cause


def test_a_one_call_reading_names_its_calls_where_users_read_its_source():
    """The docs' source column and the help text name the NVML functions the backend calls
    for the metric (the newest variant first)."""
    assert gm.ONE_CALL
    for m in gm.ONE_CALL:
        for function in m.nvml.functions:
            assert f"`{function}" in m.source, (m.name, function)
            assert function in m.help, (m.name, function)


def test_the_demo_shows_every_gauge_its_descriptor_gives_a_figure():
    """A demo GPU pinned at 40 % busy: each such gauge at its descriptor's value."""
    clock = FakeClock()
    page = families(DemoBackend(1, load=0.4, clock=clock, host="descriptors"), clock)
    for m in gm.DEMO_GAUGES:
        (sample,) = page[m.name]
        assert sample.value == pytest.approx(m.demo_value(0.4)), m.name
    assert page["gputrain_gpu_power_limit_watts"][0].value == 700.0
