"""Host readings through psutil: CPU, memory, disk and network I/O.

Each reader takes the psutil module as an argument (tests pass a fake) and returns plain data;
the sampler times each one and the collectors turn the result into metric families.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

# node_exporter's default: whole disks only, not partitions, RAM disks or loop devices.
DEFAULT_DISK_EXCLUDE = r"^(z?ram|loop|fd|sr|(h|s|v|xv)d[a-z]+\d|nvme\d+n\d+p|mmcblk\d+p)\d*$"
# Interfaces that carry no traffic from outside the host.
DEFAULT_NETDEV_EXCLUDE = (
    r"^(lo|docker\d*|veth.*|br-.*|virbr.*|cni.*|flannel.*|cali.*|vxlan.*|tun.*|tap.*|kube-.*"
    r"|cilium.*|lxc.*|dummy.*)$"
)
SYS_VIRTUAL_NET = "/sys/devices/virtual/net"


@dataclass(frozen=True)
class CpuReading:
    seconds_by_mode: dict[str, float]
    count: int


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: float
    available_bytes: float


@dataclass(frozen=True)
class DiskReading:
    read_bytes: float
    written_bytes: float
    io_time_seconds: float | None


@dataclass(frozen=True)
class NetworkReading:
    received_bytes: float
    transmitted_bytes: float
    speed_bytes_per_second: float | None


class HostReader:
    """Reads the host through a psutil-shaped module."""

    def __init__(self, psutil_module: Any = None, disk_exclude: str = DEFAULT_DISK_EXCLUDE,
                 netdev_exclude: str = DEFAULT_NETDEV_EXCLUDE,
                 virtual_net_dir: str = SYS_VIRTUAL_NET,
                 netdev_speed: dict[str, float] | None = None) -> None:
        if psutil_module is None:
            import psutil as psutil_module
        self.psutil = psutil_module
        self._disk_exclude = re.compile(disk_exclude) if disk_exclude else None
        self._netdev_exclude = re.compile(netdev_exclude) if netdev_exclude else None
        self._virtual_net_dir = virtual_net_dir
        self._netdev_speed = netdev_speed or {}  # bytes/s by interface, '*' for any

    def cpu(self) -> CpuReading:
        """Seconds spent per mode, summed over all CPUs, since boot."""
        times = self.psutil.cpu_times()
        modes = {name: float(getattr(times, name)) for name in times._fields}
        # psutil counts guest time inside user/nice already (as /proc/stat does).
        modes.pop("guest", None)
        modes.pop("guest_nice", None)
        return CpuReading(modes, int(self.psutil.cpu_count(logical=True) or 0))

    def memory(self) -> MemoryReading:
        vm = self.psutil.virtual_memory()
        return MemoryReading(float(vm.total), float(vm.available))

    def disks(self) -> dict[str, DiskReading]:
        counters = self.psutil.disk_io_counters(perdisk=True, nowrap=True) or {}
        out = {}
        for device, c in counters.items():
            if self._disk_exclude and self._disk_exclude.match(device):
                continue
            busy_ms = getattr(c, "busy_time", None)  # Linux only
            out[device] = DiskReading(float(c.read_bytes), float(c.write_bytes),
                                      None if busy_ms is None else busy_ms / 1000.0)
        return out

    def networks(self) -> dict[str, NetworkReading]:
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
                speed = self._netdev_speed.get(nic, self._netdev_speed.get("*"))
            out[nic] = NetworkReading(float(c.bytes_recv), float(c.bytes_sent), speed)
        return out

    def _is_virtual(self, nic: str) -> bool:
        if self._netdev_exclude is None:
            return False
        if self._netdev_exclude.match(nic):
            return True
        return os.path.isdir(os.path.join(self._virtual_net_dir, nic))
