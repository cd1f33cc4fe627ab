"""A host process as NVML names it, joined to what a process in a container knows of itself.

NVML lists processes by their host pid (the driver has no PID namespaces). A trainer in a
container pushes the pid it sees (the last entry of ``NSpid:`` in ``/proc/<pid>/status``) and
its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot, the same in every
namespace): together they name one host process, since pid 1 or 7 exists in every container.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class HostProcess(NamedTuple):
    """What the daemon reads of one host process."""

    pid: int  # as the host (and NVML) numbers it
    ns_pid: int  # as the process numbers itself (innermost PID namespace)
    ppid: int  # the host pid of its parent (0 for none)
    start_ticks: int | None  # clock ticks after boot it started


def _stat_fields(pid: int | str, proc: str | Path) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields from the third (state) on, or None if gone."""
    try:
        text = (Path(proc) / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # the command name may hold spaces and parentheses: the fields start after the last ')'
    return text[text.rindex(")") + 2:].split()


def read_stat(pid: int | str, proc: str | Path = "/proc") -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) from ``/proc/<pid>/stat``, or None if gone."""
    fields = _stat_fields(pid, proc)
    try:
        return (int(fields[1]), int(fields[19])) if fields else None  # fields 4 and 22
    except (IndexError, ValueError):
        return None


def read_state(pid: int | str, proc: str | Path = "/proc") -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from ``/proc/<pid>/stat``: ``T`` is stopped
    (SIGSTOP, Ctrl-Z); None if gone."""
    fields = _stat_fields(pid, proc)
    try:
        return (fields[0], int(fields[19])) if fields else None  # fields 3 and 22
    except (IndexError, ValueError):
        return None


def runs_as(state: tuple[str, int] | None, start_ticks: int | None) -> bool:
    """Whether ``state`` (:func:`read_state`'s) is a process that runs and started at
    ``start_ticks``: not gone, not a zombie, not another process that took the pid."""
    return state is not None and state[0] not in "ZX" and state[1] == start_ticks


def read_process(pid: int, proc: str | Path = "/proc") -> HostProcess | None:
    """The host process ``pid`` as this /proc shows it, or None where it cannot be read (gone,
    or a /proc of another PID namespace: a daemon without hostPID)."""
    stat = read_stat(pid, proc)
    if stat is None:
        return None
    ns_pid = pid
    try:
        with open(Path(proc) / str(pid) / "status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    ns_pid = int(line.split()[-1])  # a kernel before 4.1 has no NSpid
                    break
    except (OSError, ValueError, IndexError):
        return None
    return HostProcess(pid, ns_pid, stat[0], stat[1])


def find_host_pid(ns_pid: int, start_ticks: int, proc: str | Path = "/proc") -> int | None:
    """The host pid of the process that calls itself ``ns_pid`` and started at
    ``start_ticks``: ``ns_pid`` itself when it is that process (no container), else a scan of
    /proc. None when no process here matches, or more than one does."""
    me = read_process(ns_pid, proc)
    if me is not None and me.ns_pid == ns_pid and me.start_ticks == start_ticks:
        return ns_pid
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    found = []
    for name in names:
        if not name.isdigit():
            continue
        stat = read_stat(name, proc)
        if stat is None or stat[1] != start_ticks:
            continue
        p = read_process(int(name), proc)
        if p is not None and p.ns_pid == ns_pid:
            found.append(p.pid)
    # two containers' pid 1 started in one clock tick: neither can be told for the other
    return found[0] if len(found) == 1 else None


def process_gone(pid: int | str, proc: str | Path = "/proc") -> bool:
    """Whether ``/proc/<pid>`` is absent (the process is gone, or was never in this PID
    namespace), as opposed to unreadable (another error: out of descriptors, say)."""
    try:
        os.stat(Path(proc) / str(pid))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return False


def read_oom_kills(proc: str | Path = "/proc") -> int | None:
    """How many processes the kernel's OOM killer has killed since boot, on the whole node
    (``oom_kill`` of ``/proc/vmstat``: a kill inside a cgroup's limit counts too), or None
    where the kernel does not say (before 4.13)."""
    try:
        with open(Path(proc) / "vmstat", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
