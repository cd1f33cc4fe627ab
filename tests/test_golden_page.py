"""The whole /metrics page, end to end through the real composition of collectors, pinned by
a golden file (node_exporter's end-to-end fixture): GPUs through the real nvidia-ml-py binding over
the fake NVML driver (an H100 SXM and a V100, as their nvidia-smi outputs read), the host through
a fake psutil, training through one push. Rewrite it with
``pytest tests/test_golden_page.py --update-golden`` and review the diff."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import FakeClock
from fake_nvml import FakeDriver, h100_sxm, v100_sxm2
from test_host_collector import FakePsutil

from exporter.reading.collectors import host_collectors
from exporter.reading.gpu_backends import NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.reading.sampler import Sampler
from exporter.serving.attribution import Attribution, Owners
from exporter.serving.exposition import Exposition
from exporter.serving.ingest import IngestStore

pytestmark = pytest.mark.nvml
GOLDEN = Path(__file__).parent / "golden" / "metrics_page.prom"
WALL = 1_795_000_000.0
# What no fake can pin: the exporter process's own /proc figures, the Python version and the
# wall time of the training collector's render.
UNPINNED = [
    (re.compile(r"^(# (HELP|TYPE) )?gputrain_exporter_process_.*\n", re.M), ""),
    (re.compile(r'python_version="[^"]*"'), 'python_version="X"'),
    (re.compile(r'^(gputrain_collector_(duration_seconds|last_success_timestamp_seconds)'
                r'\{collector="training"\}) .*$', re.M), r"\1 X"),
]


# a process no rank owns, with a pid over Linux's largest (so no real process is its parent)
STRANGER = 2**22 + 100


def page(tmp_path) -> str:
    clock = FakeClock()
    gpus = [h100_sxm(0, uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000",
                     processes=[(4242, 20 * 2**30)], util_samples=[(100, 40), (200, 60)],
                     nvlink_rx_kib=2**20, nvlink_tx_kib=2**19, nvlink_down={17},
                     ecc_volatile={0: 3, 1: 0}, remapped_rows=(2, 0, 0, 0)),
            v100_sxm2(1, uuid="GPU-11111111-aaaa-bbbb-cccc-111111111111",
                      bus_id="00000000:28:00.0", name="Tesla V100-SXM2-16GB",
                      memory_total=16160 * 2**20, retired_pages={0: [0x1000, 0x2000], 1: []},
                      retired_pending=1, processes=[(STRANGER, 2**30)])]
    driver = FakeDriver(gpus, version="575.51.03", clock=clock)
    (tmp_path / "virtual").mkdir()
    host = host_collectors(psutil_module=FakePsutil(),
                           network={"virtual_net_dir": str(tmp_path / "virtual")})
    sampler = Sampler(NvmlBackend(Nvml(driver.binding), clock=clock), host, interval=1.0,
                      clock=clock, wall_clock=lambda: WALL + clock.now)
    store = IngestStore(clock=clock, wall_clock=lambda: WALL + clock.now)
    for _ in range(3):
        sampler.run_once()
        clock.advance(1.0)
    store.push(json.dumps({
        "version": 1, "run": "resnet18", "rank": "0", "run_id": "abc123", "steps": 10,
        "step_seconds": 2.0, "data_wait_seconds": 0.5, "samples": 320, "elapsed_seconds": 2.75,
        "step_buckets": [0.1, 0.25, 1.0], "step_counts": [2, 9, 10],
        "phases": {"checkpoint": 0.25, "callbacks": 0.1}, "last_step_timestamp": WALL,
        "process": {"cpu_seconds": 12.5, "resident_memory_bytes": 1e9, "read_bytes": 4096,
                    "pid": 4242}}).encode())
    store.count(200)
    # the fake driver's pids are no processes of this machine: a scripted process table
    # (each its own root) makes the stranger a stranger rather than a process the daemon
    # cannot read (whose share would be unknown)
    views = Attribution(Owners(parent_of=lambda pid: None))
    views.update(sampler.snapshot, store.states())  # the last cycle's join, with the push
    text = Exposition(sampler, store, views=views).render("text/plain")[0].decode()
    for pattern, replacement in UNPINNED:
        text = pattern.sub(replacement, text)
    return text


def test_the_whole_metrics_page(tmp_path, update_golden):
    text = page(tmp_path)
    if update_golden:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), \
        "the /metrics page changed: rerun with --update-golden and review the diff"
    # what the page must hold, whatever the golden says
    for family in ("gputrain_gpu_info", "gputrain_gpu_busy_seconds_total",
                   "gputrain_host_cpu_seconds_total", "gputrain_host_memory_available_bytes",
                   "gputrain_training_steps_total", "gputrain_training_gpu_info",
                   "gputrain_collector_success", "gputrain_build_info"):
        assert f"# TYPE {family} " in text, family
