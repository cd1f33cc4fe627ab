"""Host readings through a fake psutil (as client_python tests ProcessCollector on a fake /proc)."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from exporter.reading.collectors import COLLECTORS, Rendered, SelfCollector, host_collectors
from exporter.reading.collectors.cpu import CpuCollector
from exporter.reading.collectors.memory import MemoryCollector
from exporter.reading.collectors.network import NetworkCollector
from exporter.reading.sampler import Sampler

CpuTimes = namedtuple("scputimes",
                      "user nice system idle iowait irq softirq steal guest guest_nice")
Disk = namedtuple("sdiskio", "read_count write_count read_bytes write_bytes read_time write_time "
                  "read_merged_count write_merged_count busy_time")
Nic = namedtuple("snetio", "bytes_sent bytes_recv packets_sent packets_recv errin errout dropin "
                 "dropout")
NicStats = namedtuple("snicstats", "isup duplex speed mtu flags")


class FakePsutil:
    def __init__(self) -> None:
        self.fail = set()

    def cpu_times(self):
        if "cpu" in self.fail:
            raise OSError("cannot read /proc/stat")
        return CpuTimes(100.0, 1.0, 20.0, 800.0, 30.0, 0.5, 0.25, 0.0, 7.0, 0.0)

    def cpu_count(self, logical=True):
        return 16

    def virtual_memory(self):
        return SimpleNamespace(total=64 * 1024**3, available=48 * 1024**3)

    def disk_io_counters(self, perdisk=True, nowrap=True):
        disk = Disk(1, 2, 4096, 8192, 0, 0, 0, 0, 1500)
        return {"nvme0n1": disk, "nvme0n1p1": disk, "sda": disk, "sda1": disk, "loop0": disk}

    def net_io_counters(self, pernic=True, nowrap=True):
        n = Nic(1000, 5000, 1, 1, 0, 0, 0, 0)
        return {"eth0": n, "lo": n, "docker0": n, "veth12ab": n, "ib0": n}

    def net_if_stats(self):
        return {"eth0": NicStats(True, 2, 25000, 1500, ""), "ib0": NicStats(True, 2, 0, 4092, "")}


def make(tmp_path, psutil=None):
    psutil = psutil or FakePsutil()
    (tmp_path / "virtual").mkdir()
    collectors = host_collectors(psutil_module=psutil,
                                 network={"virtual_net_dir": str(tmp_path / "virtual")})
    sampler = Sampler(None, collectors, interval=1.0)
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(Rendered(c, lambda: sampler.snapshot))
    registry.register(SelfCollector(lambda: sampler.snapshot))
    return psutil, sampler, registry


def test_host_metrics_in_base_units(tmp_path):
    _, sampler, reg = make(tmp_path)
    sampler.run_once()
    v = reg.get_sample_value
    assert v("gputrain_host_cpu_seconds_total", {"mode": "iowait"}) == 30.0
    assert v("gputrain_host_cpu_seconds_total", {"mode": "user"}) == 100.0
    assert v("gputrain_host_cpu_seconds_total", {"mode": "guest"}) is None  # counted in user
    assert v("gputrain_host_cpus") == 16
    assert v("gputrain_host_memory_total_bytes") == 64 * 1024**3
    assert v("gputrain_host_memory_available_bytes") == 48 * 1024**3
    assert v("gputrain_host_disk_read_bytes_total", {"device": "nvme0n1"}) == 4096
    assert v("gputrain_host_disk_written_bytes_total", {"device": "sda"}) == 8192
    assert v("gputrain_host_disk_io_time_seconds_total", {"device": "sda"}) == 1.5
    assert v("gputrain_host_network_received_bytes_total", {"interface": "eth0"}) == 5000
    assert v("gputrain_host_network_transmitted_bytes_total", {"interface": "eth0"}) == 1000
    assert v("gputrain_host_network_speed_bytes_per_second", {"interface": "eth0"}) == 25e9 / 8
    # unknown speed is left out, not exported as 0
    assert v("gputrain_host_network_speed_bytes_per_second", {"interface": "ib0"}) is None


def test_partitions_loop_devices_and_virtual_interfaces_are_left_out(tmp_path):
    _, sampler, _reg = make(tmp_path)
    (tmp_path / "virtual" / "ib0").mkdir()  # listed under /sys/devices/virtual/net
    sampler.run_once()
    snap = sampler.snapshot
    assert sorted(snap.host["disk"]) == ["nvme0n1", "sda"]
    assert sorted(snap.host["network"]) == ["eth0"]


def test_one_broken_host_reader_does_not_fail_the_others(tmp_path):
    psutil, sampler, reg = make(tmp_path)
    psutil.fail.add("cpu")
    sampler.run_once()
    assert reg.get_sample_value("gputrain_collector_success", {"collector": "cpu"}) == 0
    assert reg.get_sample_value("gputrain_collector_success", {"collector": "memory"}) == 1
    assert reg.get_sample_value("gputrain_host_cpus") is None
    assert reg.get_sample_value("gputrain_host_memory_total_bytes") == 64 * 1024**3
    assert reg.get_sample_value("gputrain_collector_last_success_timestamp_seconds",
                                {"collector": "cpu"}) is None
    assert reg.get_sample_value("gputrain_collector_duration_seconds",
                                {"collector": "cpu"}) is not None


def test_real_psutil_reads_this_machine():
    cpu = CpuCollector().read()
    assert cpu.count >= 1 and cpu.seconds_by_mode["idle"] > 0
    assert MemoryCollector().read().total_bytes > 0


def test_a_configured_link_speed_fills_in_where_the_driver_reports_none(tmp_path):
    from exporter.config import parse_link_speeds

    (tmp_path / "virtual").mkdir()
    speeds = parse_link_speeds("ib0=100Gbit, *=10Gbit")
    assert speeds == {"ib0": 100e9 / 8, "*": 10e9 / 8}
    nets = NetworkCollector(FakePsutil(), virtual_net_dir=str(tmp_path / "virtual"),
                            speed=speeds).read()
    assert nets["ib0"].speed_bytes_per_second == 100e9 / 8
    assert nets["eth0"].speed_bytes_per_second == 25e9 / 8  # the driver's own figure wins
    assert parse_link_speeds("25Gbit") == {"*": 25e9 / 8}
    with pytest.raises(ValueError, match="10Gbit"):
        parse_link_speeds("eth0=fast")


def test_the_collector_table_gives_every_collector_a_flag_and_its_own_health_series(tmp_path):
    """node_exporter's registerCollector: each row is a --collector.<name> flag, and each host
    collector reports its own success and duration."""
    import argparse

    from exporter.config import Settings, add_flags, resolve

    parser = argparse.ArgumentParser()
    add_flags(parser)
    ns = parser.parse_args(["--no-collector.disk"])
    settings: Settings = resolve(ns)
    off_by_default = {name for name, entry in COLLECTORS.items() if not entry.default}
    assert off_by_default == {"kubernetes", "slurm", "nccl"}  # each needs its source
    assert settings.collectors == set(COLLECTORS) - {"disk"} - off_by_default
    collectors = host_collectors(settings.collectors, settings.values,
                                 psutil_module=FakePsutil())
    assert [c.name for c in collectors] == ["cpu", "memory", "network"]
    sampler = Sampler(None, collectors, interval=1.0)
    sampler.run_once()
    assert set(sampler.snapshot.collectors) == {"cpu", "memory", "network"}


def test_describe_lets_the_registry_catch_a_duplicate_family(tmp_path):
    """Two collectors that would export the same family are refused at registration, not
    rendered as a page Prometheus rejects."""
    _, sampler, registry = make(tmp_path)
    with pytest.raises(ValueError, match="gputrain_host_cpu"):
        registry.register(Rendered(CpuCollector(FakePsutil()), lambda: sampler.snapshot))
