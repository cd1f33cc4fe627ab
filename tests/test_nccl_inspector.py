"""NCCL Inspector's Prometheus textfiles (its README's format: ``nccl_bus_bandwidth_gbs`` and
friends, one sample per collective, labelled ``comm_id``, ``collective``, ``rank``, ``coll_sn``,
``timestamp``, ...) read by ``--collector.nccl``: the latest collective of each communicator,
in bytes per second, and never a series per collective."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import ROOT, sample_value

from exporter.reading.collectors.nccl import MAX_SERIES, NcclInspectorCollector

FIXTURE = ROOT / "tests" / "data" / "nccl_inspector"
ALLREDUCE = {"comm_id": "0xd152c00f111816", "collective": "AllReduce", "nccl_rank": "4",
             "n_ranks": "8", "n_nodes": "1"}
SCATTER = {"comm_id": "0x7f8c496ae9f661", "collective": "ReduceScatter", "nccl_rank": "4",
           "n_ranks": "16", "n_nodes": "2"}


def _line(sn: int, value: float, comm: str = "0xd152c00f111816") -> str:
    return (f'nccl_bus_bandwidth_gbs{{comm_id="{comm}",collective="AllReduce",hostname="h",'
            f'rank="0",slurm_job="unknown",slurm_job_id="unknown",pid="1",n_ranks="2",'
            f'n_nodes="1",coll_sn="{sn}",coll_timing_source="kernel_gpu",'
            f'timestamp="2025-10-17T03:31:47Z",gpu_device_id="GPU0",message_size="1.00MB"}} '
            f"{value}\n")


def test_the_daemon_exports_each_communicators_latest_bus_bandwidth(daemon_factory, tmp_path):
    """Through a real daemon and its /metrics: the AllReduce's latest collective (coll_sn
    228924: 412.25 GB/s, not the earlier 401.5), and a ReduceScatter at 3.125 GB/s, the figure
    of NCCL fallen back to TCP on a 400 Gb/s fabric; no per-collective label on any series."""
    directory = tmp_path / "inspector"
    shutil.copytree(FIXTURE, directory)
    d = daemon_factory("--gpu.backend=demo", "--collector.nccl",
                       f"--nccl.inspector-dir={directory}")
    name = "gputrain_nccl_bus_bandwidth_bytes_per_second"
    assert d.wait_sample(name, ALLREDUCE) == 412.25e9
    text = d.metrics()
    assert sample_value(text, name, SCATTER) == 3.125e9
    assert sample_value(text, "gputrain_nccl_algorithm_bandwidth_bytes_per_second",
                        ALLREDUCE) == 235.5e9
    assert sample_value(text, "gputrain_nccl_collective_duration_seconds",
                        ALLREDUCE) == 9120e-6
    lines = [x for x in text.splitlines() if x.startswith("gputrain_nccl_")]
    assert len(lines) == 4
    assert not any(k in x for x in lines for k in ("coll_sn", "timestamp", "pid=", "message_size"))
    assert sample_value(text, "gputrain_collector_success", {"collector": "nccl"}) == 1


def test_a_thousand_collectives_and_many_communicators_stay_bounded(tmp_path):
    """A file of 1,000 collectives of one communicator is one series (the highest coll_sn's);
    communicators past MAX_SERIES are left out rather than grow the page."""
    (tmp_path / "a.prom").write_text(
        "# TYPE nccl_bus_bandwidth_gbs gauge\n"
        + "".join(_line(sn, sn / 100) for sn in range(1000)))
    reading = NcclInspectorCollector(directory=str(tmp_path)).read()
    assert len(reading) == 1
    ((sn, values),) = reading.values()
    assert sn == 999 and values["gputrain_nccl_bus_bandwidth_bytes_per_second"] == 9.99e9
    (tmp_path / "b.prom").write_text(
        "# TYPE nccl_bus_bandwidth_gbs gauge\n"
        + "".join(_line(1, 1.0, comm=f"0x{i:x}") for i in range(MAX_SERIES + 50)))
    assert len(NcclInspectorCollector(directory=str(tmp_path)).read()) == MAX_SERIES


def test_no_directory_is_no_collective_and_a_broken_file_is_left_out(tmp_path):
    assert NcclInspectorCollector(directory=str(tmp_path / "absent")).read() == {}
    (tmp_path / "broken.prom").write_text("nccl_bus_bandwidth_gbs{comm_id= 12 12\n")
    shutil.copy(FIXTURE / "nccl_inspector_GPU-4f1c.prom", tmp_path / "good.prom")
    (tmp_path / "sub").mkdir()
    reading = NcclInspectorCollector(directory=str(tmp_path)).read()
    assert len(reading) == 2


def test_the_fixture_is_in_the_documented_format():
    text = Path(FIXTURE / "nccl_inspector_GPU-4f1c.prom").read_text()
    for name in ("nccl_bus_bandwidth_gbs", "nccl_algorithm_bandwidth_gbs",
                 "nccl_collective_exec_time_microseconds"):
        assert f"# TYPE {name} gauge" in text
    for label in ("comm_id", "collective", "hostname", "rank", "slurm_job", "slurm_job_id",
                  "pid", "n_ranks", "n_nodes", "coll_sn", "coll_timing_source"):
        assert f'{label}="' in text
