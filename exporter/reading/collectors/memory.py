"""The memory collector: physical and available memory, and the pages swapped (psutil)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.reading.collectors.base import HostCollector


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: float
    available_bytes: float
    # bytes swapped in from and out to disk since boot (/proc/vmstat's pswpin and pswpout, in
    # pages, times the page size); None where unreadable
    swapped_in_bytes: float | None = None
    swapped_out_bytes: float | None = None


class MemoryCollector(HostCollector):
    name = "memory"

    def read(self) -> MemoryReading:
        vm = self.psutil.virtual_memory()
        sin: float | None = None
        sout: float | None = None
        try:
            swap = self.psutil.swap_memory()
            sin, sout = float(swap.sin), float(swap.sout)
        except (AttributeError, OSError, RuntimeError):  # no /proc/vmstat, an old psutil
            pass
        return MemoryReading(float(vm.total), float(vm.available), sin, sout)

    def families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                                CounterMetricFamily]:
        return (GaugeMetricFamily("gputrain_host_memory_total_bytes",
                                  "Physical memory, in bytes (psutil.virtual_memory).",
                                  labels=[]),
                GaugeMetricFamily("gputrain_host_memory_available_bytes",
                                  "Memory available to new processes without swapping, in bytes "
                                  "(psutil.virtual_memory).", labels=[]),
                CounterMetricFamily("gputrain_host_swap_in_bytes_total",
                                    "Bytes swapped in from disk since boot (psutil.swap_memory, "
                                    "/proc/vmstat pswpin): memory pressure.", labels=[]),
                CounterMetricFamily("gputrain_host_swap_out_bytes_total",
                                    "Bytes swapped out to disk since boot (psutil.swap_memory, "
                                    "/proc/vmstat pswpout).", labels=[]))

    def render(self, reading: MemoryReading) -> Iterator[Metric]:
        total, available, swap_in, swap_out = self.families()
        total.add_metric([], reading.total_bytes)
        available.add_metric([], reading.available_bytes)
        yield total
        yield available
        if reading.swapped_in_bytes is not None and reading.swapped_out_bytes is not None:
            swap_in.add_metric([], reading.swapped_in_bytes)
            swap_out.add_metric([], reading.swapped_out_bytes)
            yield swap_in
            yield swap_out
