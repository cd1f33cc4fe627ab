"""Per-cycle cost of the signals issue 37 adds, against anchors in the same run.

    python bench/bench_signals.py [--n 20000]

Daemon, per push: the slow-step count over the step histogram (``slow_step_seconds``) against
parsing the same push (``parse_push``, the anchor every push already pays). Client, per push
(every 5 s): reading its cgroup v2 CPU allowance and throttled time (``CgroupCpu.read``)
against reading its process tree (``ProcessTree.read``, the anchor). Prints microseconds per
call and the ratio to the anchor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.client import DEFAULT_BUCKETS
from exporter.client.cgroup import CgroupCpu
from exporter.client.process_tree import ProcessTree
from exporter.heuristics.stalls import slow_step_seconds
from exporter.protocol import SCHEMA_VERSION
from exporter.serving.ingest import parse_push


def per_call(fn, n: int) -> float:
    """Microseconds per call, best of three runs of ``n``."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    n = ap.parse_args().n
    bounds = tuple(DEFAULT_BUCKETS)
    before = (0, 0, 0, 0, 10, 900, 990, 999, 999, 999, 999, 1000, 1000, 1000, 1000, 1000)
    after = (0, 0, 0, 0, 20, 1800, 1980, 1998, 1998, 1998, 1998, 1999, 2000, 2000, 2000, 2000)
    body = json.dumps({"version": SCHEMA_VERSION, "run": "r", "rank": "0", "run_id": "a",
                       "steps": 2000, "step_seconds": 100.0, "data_wait_seconds": 5.0,
                       "samples": 64000.0, "elapsed_seconds": 110.0,
                       "step_buckets": list(bounds), "step_counts": list(after[:-1]),
                       "process": {"cpu_seconds": 800.0, "resident_memory_bytes": 3e9}}).encode()
    daemon = [("parse_push (anchor)", lambda: parse_push(body, 0.0, 0.0)),
              ("slow_step_seconds", lambda: slow_step_seconds(bounds, before, after, 50.0))]
    tree, cgroup = ProcessTree(os.getpid()), CgroupCpu(os.getpid())
    client = [("ProcessTree.read (anchor)", tree.read), ("CgroupCpu.read", cgroup.read)]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, cgroup read: "
          f"{cgroup.read() or 'no cgroup v2'}")
    for title, pair, calls in (("daemon, per push", daemon, n), ("client, per push", client,
                                                                  max(1, n // 100))):
        anchor = per_call(pair[0][1], calls)
        print(f"{title}:")
        for name, fn in pair:
            us = anchor if fn is pair[0][1] else per_call(fn, calls)
            print(f"  {name:28s} {us:9.2f} us   {us / anchor:5.2f}x")


if __name__ == "__main__":
    main()
