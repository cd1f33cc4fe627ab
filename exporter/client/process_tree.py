"""CPU seconds, resident memory and bytes read by a training process and its children.

The children are the DataLoader workers. On Linux it reads ``/proc`` directly (the root is a
parameter, so a test passes a fake one, as prometheus_client's ProcessCollector test does);
elsewhere it asks psutil. CPU and read bytes are accumulated per pid from deltas, so a worker
that exits keeps its share and the totals never go down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from exporter.reading.host_processes import read_stat

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ProcessTree:
    """Reads process ``pid`` and its descendants; each :meth:`read` returns the totals."""

    def __init__(self, pid: int, proc: str = "/proc", psutil_module: Any = None) -> None:
        self.pid = pid
        self._proc = Path(proc)
        self._use_proc = (self._proc / str(pid) / "stat").exists()
        self._psutil = psutil_module
        if not self._use_proc and psutil_module is None:
            import psutil

            self._psutil = psutil
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (cpu seconds, read bytes)
        # clock ticks after boot (the same in every PID namespace): with the pid, it names
        # this process to a daemon that sees the host's pids (NVML's)
        stat = read_stat(pid, self._proc) if self._use_proc else None
        self.start_time = None if stat is None else stat[1]
        self.cpu_seconds = 0.0
        self.read_bytes = 0.0

    def read(self) -> dict[str, float]:
        """Cumulative CPU seconds and read bytes, and the current RSS in bytes, of the tree."""
        readings = self._read_proc() if self._use_proc else self._read_psutil()
        rss, seen = 0.0, {}
        for pid, (cpu, read, resident) in readings.items():
            before = self._last.get(pid, (0.0, 0.0))
            self.cpu_seconds += max(0.0, cpu - before[0])
            self.read_bytes += max(0.0, read - before[1])
            rss += resident
            seen[pid] = (cpu, read)
        self._last = seen
        out: dict[str, float] = {"cpu_seconds": self.cpu_seconds, "resident_memory_bytes": rss,
                                 "read_bytes": self.read_bytes, "pid": self.pid}
        if self.start_time is not None:
            out["start_time"] = self.start_time
        return out

    # -- /proc ------------------------------------------------------------------------------

    def _stat(self, pid: int) -> tuple[int, float, float] | None:
        """(parent pid, CPU seconds, RSS bytes) from /proc/<pid>/stat, or None if gone."""
        try:
            text = (self._proc / str(pid) / "stat").read_text()
        except OSError:
            return None
        # the command name may hold spaces and parentheses: the fields start after the last ')'
        fields = text[text.rindex(")") + 2:].split()
        ppid = int(fields[1])
        cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
        rss = int(fields[21]) * PAGE_SIZE
        return ppid, cpu, float(rss)

    def _read_bytes(self, pid: int) -> float:
        try:
            for line in (self._proc / str(pid) / "io").read_text().splitlines():
                if line.startswith("rchar:"):
                    return float(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0.0

    def _read_proc(self) -> dict[int, tuple[float, float, float]]:
        stats: dict[int, tuple[int, float, float]] = {}
        for entry in self._proc.iterdir():
            if entry.name.isdigit():
                st = self._stat(int(entry.name))
                if st is not None:
                    stats[int(entry.name)] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = {}, [self.pid]
        while todo:
            pid = todo.pop()
            if pid in stats and pid not in out:
                _, cpu, rss = stats[pid]
                out[pid] = (cpu, self._read_bytes(pid), rss)
                todo.extend(children.get(pid, ()))
        return out

    # -- psutil (not Linux) ------------------------------------------------------------------

    def _read_psutil(self) -> dict[int, tuple[float, float, float]]:
        psutil = self._psutil
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        out = {}
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    try:
                        io = p.io_counters()
                        read = float(getattr(io, "read_chars", io.read_bytes))
                    except (psutil.Error, AttributeError, NotImplementedError):
                        read = 0.0
                    out[p.pid] = (t.user + t.system, read, float(p.memory_info().rss))
            except psutil.Error:
                continue
        return out
