"""The disk collector: bytes read and written and busy time per whole disk (psutil)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from exporter.reading.collectors.base import HostCollector

# node_exporter's default: whole disks only, not partitions, RAM disks or loop devices.
DEFAULT_DISK_EXCLUDE = r"^(z?ram|loop|fd|sr|(h|s|v|xv)d[a-z]+\d|nvme\d+n\d+p|mmcblk\d+p)\d*$"


@dataclass(frozen=True)
class DiskReading:
    read_bytes: float
    written_bytes: float
    io_time_seconds: float | None


class DiskCollector(HostCollector):
    name = "disk"

    def __init__(self, psutil_module: Any = None, exclude: str = DEFAULT_DISK_EXCLUDE) -> None:
        super().__init__(psutil_module)
        self._exclude = re.compile(exclude) if exclude else None

    def read(self) -> dict[str, DiskReading]:
        counters = self.psutil.disk_io_counters(perdisk=True, nowrap=True) or {}
        out = {}
        for device, c in counters.items():
            if self._exclude and self._exclude.match(device):
                continue
            busy_ms = getattr(c, "busy_time", None)  # Linux only
            out[device] = DiskReading(float(c.read_bytes), float(c.write_bytes),
                                      None if busy_ms is None else busy_ms / 1000.0)
        return out

    def families(self) -> tuple[CounterMetricFamily, ...]:
        return (CounterMetricFamily("gputrain_host_disk_read_bytes_total",
                                    "Bytes read from the disk (psutil.disk_io_counters).",
                                    labels=["device"]),
                CounterMetricFamily("gputrain_host_disk_written_bytes_total",
                                    "Bytes written to the disk (psutil.disk_io_counters).",
                                    labels=["device"]),
                CounterMetricFamily("gputrain_host_disk_io_time_seconds_total",
                                    "Seconds the disk had I/O in flight; rate() is its busy ratio "
                                    "(psutil.disk_io_counters busy_time).", labels=["device"]))

    def render(self, reading: dict[str, DiskReading]) -> Iterator[Metric]:
        if not reading:
            return
        read, written, busy = self.families()
        for dev, d in sorted(reading.items()):
            read.add_metric([dev], d.read_bytes)
            written.add_metric([dev], d.written_bytes)
            if d.io_time_seconds is not None:
                busy.add_metric([dev], d.io_time_seconds)
        yield read
        yield written
        if busy.samples:
            yield busy
