"""The cpu collector: CPU seconds by mode and the number of logical CPUs (psutil)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.reading.collectors.base import HostCollector


@dataclass(frozen=True)
class CpuReading:
    seconds_by_mode: dict[str, float]
    count: int


class CpuCollector(HostCollector):
    name = "cpu"

    def read(self) -> CpuReading:
        """Seconds spent per mode, summed over all CPUs, since boot."""
        times = self.psutil.cpu_times()
        modes = {name: float(getattr(times, name)) for name in times._fields}
        # psutil counts guest time inside user/nice already (as /proc/stat does).
        modes.pop("guest", None)
        modes.pop("guest_nice", None)
        return CpuReading(modes, int(self.psutil.cpu_count(logical=True) or 0))

    def families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        return (CounterMetricFamily(
                    "gputrain_host_cpu_seconds_total",
                    "CPU seconds spent in each mode, summed over all CPUs (psutil.cpu_times).",
                    labels=["mode"]),
                GaugeMetricFamily("gputrain_host_cpus", "Logical CPUs (psutil.cpu_count).",
                                  labels=[]))

    def render(self, reading: CpuReading) -> Iterator[Metric]:
        seconds, count = self.families()
        for mode, value in sorted(reading.seconds_by_mode.items()):
            seconds.add_metric([mode], value)
        count.add_metric([], reading.count)
        yield seconds
        yield count
