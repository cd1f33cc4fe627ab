"""Host metric families (CPU, memory, disk, network) from a snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.sampler import Snapshot


class HostCollector:
    """Renders the host part of the latest snapshot; a failed reader renders nothing."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap.cpu is not None:
            cpu = CounterMetricFamily(
                "gputrain_host_cpu_seconds_total",
                "CPU seconds spent in each mode, summed over all CPUs (psutil.cpu_times).",
                labels=["mode"])
            for mode, seconds in sorted(snap.cpu.seconds_by_mode.items()):
                cpu.add_metric([mode], seconds)
            yield cpu
            yield GaugeMetricFamily("gputrain_host_cpus",
                                    "Logical CPUs (psutil.cpu_count).", value=snap.cpu.count)
        if snap.memory is not None:
            yield GaugeMetricFamily("gputrain_host_memory_total_bytes",
                                    "Physical memory, in bytes (psutil.virtual_memory).",
                                    value=snap.memory.total_bytes)
            yield GaugeMetricFamily(
                "gputrain_host_memory_available_bytes",
                "Memory available to new processes without swapping, in bytes "
                "(psutil.virtual_memory).", value=snap.memory.available_bytes)
        if snap.disks:
            read = CounterMetricFamily("gputrain_host_disk_read_bytes_total",
                                       "Bytes read from the disk (psutil.disk_io_counters).",
                                       labels=["device"])
            written = CounterMetricFamily("gputrain_host_disk_written_bytes_total",
                                          "Bytes written to the disk (psutil.disk_io_counters).",
                                          labels=["device"])
            busy = CounterMetricFamily(
                "gputrain_host_disk_io_time_seconds_total",
                "Seconds the disk had I/O in flight; rate() is its busy ratio "
                "(psutil.disk_io_counters busy_time).", labels=["device"])
            for dev, d in sorted(snap.disks.items()):
                read.add_metric([dev], d.read_bytes)
                written.add_metric([dev], d.written_bytes)
                if d.io_time_seconds is not None:
                    busy.add_metric([dev], d.io_time_seconds)
            yield read
            yield written
            if busy.samples:
                yield busy
        if snap.networks:
            rx = CounterMetricFamily("gputrain_host_network_received_bytes_total",
                                     "Bytes received (psutil.net_io_counters).",
                                     labels=["interface"])
            tx = CounterMetricFamily("gputrain_host_network_transmitted_bytes_total",
                                     "Bytes sent (psutil.net_io_counters).", labels=["interface"])
            speed = GaugeMetricFamily(
                "gputrain_host_network_speed_bytes_per_second",
                "Link speed, in bytes per second (psutil.net_if_stats); absent when unknown.",
                labels=["interface"])
            for nic, n in sorted(snap.networks.items()):
                rx.add_metric([nic], n.received_bytes)
                tx.add_metric([nic], n.transmitted_bytes)
                if n.speed_bytes_per_second is not None:
                    speed.add_metric([nic], n.speed_bytes_per_second)
            yield rx
            yield tx
            if speed.samples:
                yield speed
