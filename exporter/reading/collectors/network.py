"""The network collector: bytes received and sent and link speed per interface (psutil)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.reading.collectors.base import HostCollector

# Interfaces that carry no traffic from outside the host.
DEFAULT_NETDEV_EXCLUDE = (
    r"^(lo|docker\d*|veth.*|br-.*|virbr.*|cni.*|flannel.*|cali.*|vxlan.*|tun.*|tap.*|kube-.*"
    r"|cilium.*|lxc.*|dummy.*)$"
)
SYS_VIRTUAL_NET = "/sys/devices/virtual/net"


@dataclass(frozen=True)
class NetworkReading:
    received_bytes: float
    transmitted_bytes: float
    speed_bytes_per_second: float | None


class NetworkCollector(HostCollector):
    name = "network"

    def __init__(self, psutil_module: Any = None, exclude: str = DEFAULT_NETDEV_EXCLUDE,
                 virtual_net_dir: str = SYS_VIRTUAL_NET,
                 speed: dict[str, float] | None = None) -> None:
        super().__init__(psutil_module)
        self._exclude = re.compile(exclude) if exclude else None
        self._virtual_net_dir = virtual_net_dir
        self._speed = speed or {}  # bytes/s by interface, '*' for any

    def read(self) -> dict[str, NetworkReading]:
        counters = self.psutil.net_io_counters(pernic=True, nowrap=True) or {}
        stats = self.psutil.net_if_stats() or {}
        out = {}
        for nic, c in counters.items():
            if self._is_virtual(nic):
                continue
            st = stats.get(nic)
            speed_mbit = getattr(st, "speed", 0) if st is not None else 0
            speed = speed_mbit * 1e6 / 8 if speed_mbit and speed_mbit > 0 else None
            if speed is None:
                speed = self._speed.get(nic, self._speed.get("*"))
            out[nic] = NetworkReading(float(c.bytes_recv), float(c.bytes_sent), speed)
        return out

    def _is_virtual(self, nic: str) -> bool:
        if self._exclude is None:
            return False
        if self._exclude.match(nic):
            return True
        return os.path.isdir(os.path.join(self._virtual_net_dir, nic))

    def families(self) -> tuple[CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily]:
        return (CounterMetricFamily("gputrain_host_network_received_bytes_total",
                                    "Bytes received (psutil.net_io_counters).",
                                    labels=["interface"]),
                CounterMetricFamily("gputrain_host_network_transmitted_bytes_total",
                                    "Bytes sent (psutil.net_io_counters).", labels=["interface"]),
                GaugeMetricFamily("gputrain_host_network_speed_bytes_per_second",
                                  "Link speed, in bytes per second (psutil.net_if_stats); absent "
                                  "when unknown.", labels=["interface"]))

    def render(self, reading: dict[str, NetworkReading]) -> Iterator[Metric]:
        if not reading:
            return
        rx, tx, speed = self.families()
        for nic, n in sorted(reading.items()):
            rx.add_metric([nic], n.received_bytes)
            tx.add_metric([nic], n.transmitted_bytes)
            if n.speed_bytes_per_second is not None:
                speed.add_metric([nic], n.speed_bytes_per_second)
        yield rx
        yield tx
        if speed.samples:
            yield speed
