"""The CPUs a training process may use: its cgroup v2 CPU allowance and throttled time.

A pod limited to a few cores can starve its DataLoader workers on an idle 128-core node, so
the client reports, beside its process tree's CPU seconds, the allowance its cgroup gives it
(``cpu.max`` quota over period, the smallest along the path to the root, and the CPUs of
``cpuset.cpus.effective``, in cores) and the seconds the kernel throttled it (``cpu.stat``
``throttled_usec``). The roots are parameters, so a test passes a fake tree. Cost: reading
a few small files every push (5 s), none per step.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")  # pure v2, then hybrid


def count_cpus(spec: str) -> int:
    """CPUs in a cpuset list such as ``0-3,8,10-11``."""
    n = 0
    for part in spec.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


class CgroupCpu:
    """Reads process ``pid``'s cgroup v2 CPU allowance (cores) and throttled seconds."""

    def __init__(self, pid: int | str = "self", proc: str = "/proc",
                 roots: tuple[str, ...] = CGROUP_ROOTS) -> None:
        self._dirs = self._find(Path(proc) / str(pid) / "cgroup", roots)

    @staticmethod
    def _find(cgroup_file: Path, roots: tuple[str, ...]) -> list[Path]:
        """The process's cgroup directory and its ancestors up to the root, leaf first."""
        try:
            lines = cgroup_file.read_text().splitlines()
        except OSError:
            return []
        path = next((line[3:] for line in lines if line.startswith("0::")), None)
        if path is None:
            return []
        for root in map(Path, roots):
            leaf = root / path.lstrip("/")
            if (root / "cgroup.controllers").exists() and leaf.is_dir():
                return [leaf, *[p for p in leaf.parents if p == root or root in p.parents]]
        return []

    def read(self) -> dict[str, float]:
        """``cpu_allowance_cores`` (where a quota or cpuset limits it below the machine's
        CPUs, else the machine's), ``cpu_allowance_group`` (where one does: the inode number of
        the cgroup that sets it, the same for every process under it, so the daemon divides
        the allowance among the ranks that share it) and ``cpu_throttled_seconds``; {} without
        a cgroup v2."""
        if not self._dirs:
            return {}
        cores = float(os.cpu_count() or 1)
        throttled = None
        limited_by: Path | None = None
        for d in self._dirs:
            try:
                quota, period = (d / "cpu.max").read_text().split()[:2]
                if quota != "max" and int(quota) / int(period) < cores:
                    cores, limited_by = int(quota) / int(period), d
            except (OSError, ValueError):
                pass
            with contextlib.suppress(OSError, ValueError):
                cpus = float(count_cpus((d / "cpuset.cpus.effective").read_text()) or cores)
                if cpus < cores:
                    cores, limited_by = cpus, d
            try:
                for line in (d / "cpu.stat").read_text().splitlines():
                    name, _, value = line.partition(" ")
                    if name == "throttled_usec":  # each level's own: the most counts
                        throttled = max(throttled or 0.0, int(value) / 1e6)
            except (OSError, ValueError):
                pass
        out = {"cpu_allowance_cores": cores}
        if limited_by is not None:
            with contextlib.suppress(OSError):
                out["cpu_allowance_group"] = float(limited_by.stat().st_ino)
        if throttled is not None:
            out["cpu_throttled_seconds"] = throttled
        return out
