"""The memory collector: physical and available memory (psutil)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from exporter.reading.collectors.base import HostCollector


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: float
    available_bytes: float


class MemoryCollector(HostCollector):
    name = "memory"

    def read(self) -> MemoryReading:
        vm = self.psutil.virtual_memory()
        return MemoryReading(float(vm.total), float(vm.available))

    def families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("gputrain_host_memory_total_bytes",
                                  "Physical memory, in bytes (psutil.virtual_memory).",
                                  labels=[]),
                GaugeMetricFamily("gputrain_host_memory_available_bytes",
                                  "Memory available to new processes without swapping, in bytes "
                                  "(psutil.virtual_memory).", labels=[]))

    def render(self, reading: MemoryReading) -> Iterator[Metric]:
        total, available = self.families()
        total.add_metric([], reading.total_bytes)
        available.add_metric([], reading.available_bytes)
        yield total
        yield available
