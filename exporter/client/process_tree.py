"""CPU seconds, memory and bytes read by a training process and its children.

The children are the DataLoader workers. On Linux it reads ``/proc`` directly (the root is a
parameter, so a test passes a fake one, as prometheus_client's ProcessCollector test does);
elsewhere it asks psutil. CPU and read bytes are accumulated per pid from deltas, so a worker
that exits keeps its share and the totals never go down.

Beside the tree's resident memory (RSS, which counts a page its workers share once per
worker and misses the copies they make of it as they touch it), it reads the tree's
proportional set size (PSS: a page shared by n processes counts 1/n) from
``/proc/<pid>/smaps_rollup``. The client reads it, not the daemon: it sees its own tree in any
container, where the daemon may not see the host's ``/proc``. The kernel walks every mapping
to answer (0.2-0.4 s for a tree of 5 GiB RSS), so it is read at most once per
:data:`PSS_INTERVAL_SECONDS`, and less often where a read takes longer than
:data:`PSS_MAX_DUTY` of that; the last value is pushed between reads. The read is a file read,
which releases the GIL: the training thread does not wait on it. Where any process of
the tree does not answer (no permission, a kernel before 4.14, not Linux), the tree has no
PSS, and only RSS is pushed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from exporter.reading.host_processes import read_stat

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PSS_INTERVAL_SECONDS = 60.0  # the leak rule's points are a minute apart: no need for more
# ... and at most this share of the pusher thread's time: a tree of 5 GiB RSS takes about
# 0.2-0.4 s to read (bench/bench_pss.py), one of hundreds of GiB seconds
PSS_MAX_DUTY = 0.01


class ProcessTree:
    """Reads process ``pid`` and its descendants; each :meth:`read` returns the totals."""

    def __init__(self, pid: int, proc: str = "/proc", psutil_module: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self._clock = clock
        self._pss: float | None = None  # bytes, at the last read
        self._pss_next: float | None = None  # when to read it again (the clock's seconds)
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
        """Cumulative CPU seconds and read bytes, the current RSS in bytes, and the PSS in
        bytes (at most :data:`PSS_INTERVAL_SECONDS` old; absent where unreadable) of the
        tree."""
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
        now = self._clock()
        if self._use_proc and (self._pss_next is None or now >= self._pss_next):
            self._pss = self._read_pss(readings)
            took = self._clock() - now
            self._pss_next = now + max(PSS_INTERVAL_SECONDS, took / PSS_MAX_DUTY)
        if self._pss is not None:
            out["proportional_memory_bytes"] = self._pss
        return out

    def _read_pss(self, pids: Iterable[int]) -> float | None:
        """The tree's PSS in bytes from each process's smaps_rollup; None where a live
        process of it does not answer (a sum without it would read as a fall)."""
        total = 0.0
        for pid in pids:
            try:
                text = (self._proc / str(pid) / "smaps_rollup").read_text()
            except FileNotFoundError:
                if (self._proc / str(pid)).exists():
                    return None  # a kernel before 4.14: no smaps_rollup
                continue  # it exited since the tree was read
            except OSError:  # no permission (another user's worker, a hardened /proc)
                return None
            for line in text.splitlines():
                if line.startswith("Pss:"):
                    total += float(line.split()[1]) * 1024  # kB
                    break
            else:
                return None
        return total

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
