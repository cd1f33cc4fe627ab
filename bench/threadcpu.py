"""The daemon with its CPU written by part, for the benchmarks: HTTP serving (pushes and
scrapes) apart from the sampler, page and status threads.

    python bench/threadcpu.py CPU_FILE [gputrain-exporter flags]

runs ``gputrain-exporter`` in this process and rewrites CPU_FILE (JSON, CPU seconds by part)
every 0.2 s. ``serving`` is the whole process less the named background threads, so the
threads of connections that have ended still count.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"gputrain-sampler": "sampler", "gputrain-xid": "sampler", "gputrain-page": "page",
         "gputrain-status": "status", "bench-threadcpu": "bench"}
_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu(native_id: int) -> float:
    try:
        with open(f"/proc/self/task/{native_id}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


_GC = {"gc_seconds": 0.0, "gc_max_seconds": 0.0, "gc_full": 0}
_gc_started = [0.0]


def _gc_callback(phase: str, info: dict) -> None:
    """Time each garbage collection: a full one holds the GIL while it walks every object."""
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _gc_started[0]
    _GC["gc_seconds"] += took
    if info.get("generation") == 2:
        _GC["gc_full"] += 1
        _GC["gc_max_seconds"] = max(_GC["gc_max_seconds"], took)


def snapshot() -> dict[str, float]:
    """CPU seconds so far: the process, and each background part; the time spent in garbage
    collections, their longest full one and how many."""
    t = os.times()
    out = {"total": t.user + t.system, **{p: 0.0 for p in set(PARTS.values())}, **_GC}
    for th in threading.enumerate():
        part = PARTS.get(th.name)
        if part is not None and th.native_id is not None:
            out[part] += _thread_cpu(th.native_id)
    out["serving"] = out["total"] - sum(out[p] for p in set(PARTS.values()))
    return out


def read(path: str) -> dict[str, float]:
    """The latest figures a daemon wrote (retries a half-written file)."""
    for _ in range(50):
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            threading.Event().wait(0.05)
    raise SystemExit(f"no CPU figures in {path}")


def main() -> int:
    path, argv = sys.argv[1], sys.argv[2:]

    def report() -> None:
        while True:
            tmp = path + ".tmp"
            Path(tmp).write_text(json.dumps(snapshot()))
            os.replace(tmp, path)
            threading.Event().wait(0.2)

    gc.callbacks.append(_gc_callback)
    threading.Thread(target=report, name="bench-threadcpu", daemon=True).start()
    sys.path.insert(0, str(ROOT))
    from exporter.cli.main import main as exporter_main

    return exporter_main(argv)


if __name__ == "__main__":
    sys.exit(main())
