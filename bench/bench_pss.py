"""Cost of reading a process tree's PSS (issue 37, principle 4), against the anchor in the
same run.

    python bench/bench_pss.py [--mib 1024] [--workers 4] [--n 50]

A parent holding ``--mib`` MiB (touched) forks ``--workers`` children that read all of it
(shared pages, as DataLoader workers after fork). Prints milliseconds per call of the tree's
PSS read (``smaps_rollup`` of every process: the kernel walks each one's page tables) against
the anchor every push already pays, the tree walk over ``/proc/<pid>/stat`` and ``io``
(``ProcessTree._read_proc``), and the PSS read's share of one core at the client's bounded
rate (once a minute, ``PSS_INTERVAL_SECONDS``) and if it ran at every push (every 5 s).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_signals import per_call  # microseconds per call, best of three

from exporter.client.process_tree import PSS_INTERVAL_SECONDS, ProcessTree
from exporter.protocol import DEFAULT_PUSH_INTERVAL_SECONDS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--n", type=int, default=50)
    args = ap.parse_args()
    data = bytearray(b"x" * (args.mib * 2**20))
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    children = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:
            try:
                sum(data[i] for i in range(0, len(data), 4096))  # shared, in its RSS
                os.write(ready_w, b"r")
                os.read(stop_r, 1)
            finally:
                os._exit(0)
        children.append(pid)
    for _ in children:
        os.read(ready_r, 1)
    try:
        tree = ProcessTree(os.getpid())
        pids = tree._read_proc()
        walk = per_call(tree._read_proc, args.n) / 1e3  # ms
        pss = per_call(lambda: tree._read_pss(pids), args.n) / 1e3
        reading = tree.read()
    finally:
        os.write(stop_w, b"x" * len(children))
        for pid in children:
            os.waitpid(pid, 0)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; a tree of {len(pids)} "
          f"processes, {args.mib} MiB in the parent read by {args.workers} forked workers")
    print(f"tree RSS {reading['resident_memory_bytes'] / 2**20:.0f} MiB, "
          f"PSS {reading['proportional_memory_bytes'] / 2**20:.0f} MiB")
    print(f"{'read':36} {'ms/call':>8} {'x anchor':>9} {'core % at 60 s':>15} "
          f"{'core % at 5 s':>14}")
    for name, ms in (("tree walk (stat, io): anchor", walk), ("PSS (smaps_rollup)", pss)):
        print(f"{name:36} {ms:8.3f} {ms / walk:9.2f} "
              f"{ms / 1e3 / PSS_INTERVAL_SECONDS * 100:15.4f} "
              f"{ms / 1e3 / DEFAULT_PUSH_INTERVAL_SECONDS * 100:14.4f}")


if __name__ == "__main__":
    main()
