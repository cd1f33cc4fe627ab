"""Cost of TrainingMonitor on the training thread, against two anchors in the same run.

    python bench/bench_client.py [--steps 1000000]

Anchors: a bare loop over the same iterable (the floor), and a loop that times each step and
calls prometheus_client's Histogram.observe directly (what a hand-rolled in-process metric
costs). Prints nanoseconds per step and the added cost over the bare loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, Histogram

from exporter.client import DEFAULT_BUCKETS, TrainingMonitor


def bare(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    return time.perf_counter() - t0


def histogram_observe(n: int) -> float:
    h = Histogram("step_seconds", "x", buckets=DEFAULT_BUCKETS, registry=CollectorRegistry())
    clock = time.perf_counter
    t0 = prev = clock()
    for _ in range(n):
        now = clock()
        h.observe(now - prev)
        prev = now
    return time.perf_counter() - t0


def monitor_wrap(n: int) -> float:
    m = TrainingMonitor(run="bench", endpoint="http://127.0.0.1:9", push_interval=3600,
                        start=False)
    t0 = time.perf_counter()
    for _ in m.wrap(range(n), batch_size=32):
        pass
    elapsed = time.perf_counter() - t0
    assert m.totals()["steps"] == n
    return elapsed


def monitor_context_managers(n: int) -> float:
    m = TrainingMonitor(run="bench", endpoint="http://127.0.0.1:9", push_interval=3600,
                        start=False)
    it = iter(range(n))
    t0 = time.perf_counter()
    for _ in range(n):
        with m.data_wait():
            next(it)
        with m.step(samples=32):
            pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    cases = {"bare loop": bare, "Histogram.observe": histogram_observe,
             "TrainingMonitor.wrap": monitor_wrap,
             "data_wait()+step()": monitor_context_managers}
    results: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, fn in cases.items():
            results[name].append(fn(args.steps) / args.steps * 1e9)
    floor = statistics.median(results["bare loop"])
    hist = statistics.median(results["Histogram.observe"])
    print(f"python {sys.version.split()[0]}, {args.steps} steps x {args.repeats} repeats, "
          "median ns per step")
    print(f"{'case':24} {'ns/step':>9} {'added ns':>9} {'x Histogram.observe':>20}")
    for name, values in results.items():
        med = statistics.median(values)
        added = med - floor
        ratio = added / (hist - floor) if name != "bare loop" else 0.0
        print(f"{name:24} {med:9.1f} {added:9.1f} {ratio:20.2f}")


if __name__ == "__main__":
    main()
